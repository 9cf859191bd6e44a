"""The job queue's order (turns by user) on a real SQLite registry; no Ray needed to pick."""

from __future__ import annotations

from otray.actors.control.gate import Gate
from otray.actors.control.registry import JobState, Registry
from otray.actors.control.scheduler import JobQueue, fair_pick


def test_fair_pick_takes_turns_by_user_and_keeps_each_users_order():
    queued = [("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob")]
    assert fair_pick(queued, []) == "a1"  # nobody holds anything: the oldest job
    assert fair_pick(queued, ["alice"]) == "b1"  # alice runs one: bob's turn, though he queued last
    assert fair_pick(queued, ["alice", "bob"]) == "a1"  # one each: the older job
    assert fair_pick(queued[1:], ["bob", "bob"]) == "a2"  # each user's own jobs in submit order
    assert fair_pick([("c1", "carol")], ["carol"] * 5) == "c1"


def test_the_queue_places_the_fair_pick_and_keeps_a_job_being_placed_at_the_head(tmp_path):
    registry = Registry(tmp_path / "otray.db")
    try:
        queue = JobQueue(registry, Gate(registry, False), str(tmp_path))
        jobs = {name: registry.create_job(owner, name, {}) for name, owner in
                [("a0", "alice"), ("a1", "alice"), ("a2", "alice"), ("b1", "bob")]}
        queue.queue.extend(jobs[n] for n in ("a1", "a2", "b1"))
        queue.running[jobs["a0"]] = (None, None)  # alice's first job runs
        registry.set_state(jobs["a0"], JobState.STARTING)
        assert queue._head() == jobs["b1"]
        queue.pending[jobs["a1"]] = "its placement group"  # asked for already: it stays next until placed
        assert queue._head() == jobs["a1"]
    finally:
        registry.close()
