"""The job queue's order (turns by user) on a real SQLite registry; no Ray needed to pick."""

from __future__ import annotations

import asyncio

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


def test_a_job_that_cannot_be_placed_fails_with_the_reason_and_the_queue_goes_on(tmp_path):
    """A queued job whose stored config no longer loads (a registry written by another otray, picked up
    by a restarted manager) used to end the scheduling task silently, leaving every later job QUEUED for
    ever. Now it ends FAILED with the reason, and the next job is tried (here: also unloadable)."""
    registry = Registry(tmp_path / "otray.db")
    try:
        old = [registry.create_job("alice", f"old{i}", {"nonsense_key": i}) for i in range(2)]
        queue = JobQueue(registry, Gate(registry, False), str(tmp_path))  # a restarted manager: both queued
        assert list(queue.queue) == old
        assert queue.waiting(old[1]) == "next to be placed" and queue.waiting("nope") is None
        asyncio.run(queue._schedule())
        for job_id in old:
            job = registry.job(job_id)
            assert job.state is JobState.FAILED
            assert job.error.startswith("SchedulerError: the job could not be placed: ConfigError: unknown config "
                                        "key 'nonsense_key'"), job.error
        assert not queue.queue and not queue.pending
    finally:
        registry.close()
