"""The learner's fair queue (otray.tinker.learner.fair) on its own: whose step runs next.

Steps here are timed waits standing in for learner calls (what the queue measures is their
duration, whatever they do); the SharedLearner's use of it with the real model is in
tests/tinker/test_service.py and benchmarks/tinker_fairness.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from otray.tinker.config import Share
from otray.tinker.learner.fair import FairQueue, slices


def step(ran: list[str], label: str, seconds: float):
    async def go() -> str:
        ran.append(label)
        await asyncio.sleep(seconds)
        return label

    return go


def run_jobs(queue: FairQueue, plan: list[tuple[float, str, str, int, float]]) -> list[str]:
    """Submit each (at seconds, user, client, steps, step seconds) of ``plan`` as one job; the users in
    the order their steps ran."""
    ran: list[str] = []

    async def one(at: float, user: str, client: str, n: int, cost: float) -> None:
        await asyncio.sleep(at)
        await queue.run(user, client, [step(ran, user, cost) for _ in range(n)])

    async def main() -> None:
        await asyncio.gather(*(one(*p) for p in plan))

    asyncio.run(main())
    return ran


def test_a_small_job_waits_for_one_step_of_a_user_with_many_clients_not_all():
    """alice's ten clients each send a job of 3 slices; bob's one-step job, sent just after hers began,
    runs second: after the one slice on the learner, not after all thirty. fifo: last."""
    plan = [(0.0, "alice", f"a{i}", 3, 0.01) for i in range(10)] + [(0.005, "bob", "b", 1, 0.001)]
    assert run_jobs(FairQueue(), plan).index("bob") == 1
    assert run_jobs(FairQueue(policy="fifo"), plan).index("bob") == 30


def test_a_clients_jobs_run_in_order_and_its_next_job_keeps_the_turn_it_is_owed():
    """bob's forward_backward (follow=True) ends; his optim_step arrives 20 ms later: the turn is kept
    for it (he is owed it), so alice's waiting slices do not go first."""
    async def main() -> list[str]:
        queue, ran = FairQueue(follow_s=0.2), []

        async def alice() -> None:
            await asyncio.gather(*(queue.run("alice", f"a{i}", [step(ran, "alice", 0.02)] * 3) for i in range(3)))

        async def bob() -> None:
            await asyncio.sleep(0.005)
            await queue.run("bob", "b", [step(ran, "bob-fb", 0.005)], follow=True)
            await asyncio.sleep(0.02)  # the round trip to the service and back
            await queue.run("bob", "b", [step(ran, "bob-optim", 0.001)])

        await asyncio.gather(alice(), bob())
        return ran

    ran = asyncio.run(main())
    assert ran.index("bob-optim") == ran.index("bob-fb") + 1 == 2, ran


def test_a_turn_is_not_kept_for_a_user_who_is_not_owed_it_or_past_follow_time():
    async def main(follow_s: float) -> list[str]:
        queue, ran = FairQueue(follow_s=follow_s), []

        async def bob() -> None:
            await queue.run("bob", "b", [step(ran, "bob-fb", 0.005)], follow=True)
            await asyncio.sleep(0.05)
            await queue.run("bob", "b", [step(ran, "bob-optim", 0.001)])

        async def alice() -> None:
            await asyncio.sleep(0.001)
            await queue.run("alice", "a", [step(ran, "alice", 0.01)] * 3)

        await asyncio.gather(alice(), bob())
        return ran

    assert asyncio.run(main(0.01))[:3] == ["bob-fb", "alice", "alice"]  # the follower came too late


def test_a_client_looping_steps_keeps_its_turn_across_round_trips_while_owed_it():
    """bob loops forward_backward and optim_step with a round trip between calls, beside alice's busy
    clients. While he is owed the turn it is kept for his next loop (its next job came soon last time), so
    some of his loops run back to back: without that, alice's slice started in every round trip and he got
    about a third of the learner, not half. Fair shares still hold: alice runs between his loops."""
    async def main() -> list[str]:
        queue, ran = FairQueue(follow_s=0.2), []

        async def alice() -> None:
            await asyncio.gather(*(queue.run("alice", f"a{i}", [step(ran, "alice", 0.02)] * 12) for i in range(3)))

        async def bob() -> None:
            await asyncio.sleep(0.005)
            for _ in range(10):
                await queue.run("bob", "b", [step(ran, "bob-fb", 0.01)], follow=True)
                await asyncio.sleep(0.005)  # the round trip to the service and back
                await queue.run("bob", "b", [step(ran, "bob-optim", 0.002)])
                await asyncio.sleep(0.005)

        await asyncio.gather(alice(), bob())
        return ran

    ran = asyncio.run(main())
    span = ran[ran.index("bob-fb"):len(ran) - ran[::-1].index("bob-optim")]
    back_to_back = sum(a == "bob-optim" and b == "bob-fb" for a, b in zip(span, span[1:]))
    assert back_to_back >= 3 and span.count("alice") >= 3, span


def loop_alike(users: int, loops: int, keep_alike_turns: bool = False) -> tuple[FairQueue, list[str], float]:
    """``users`` users each looping ``loops`` one-slice calls (a forward_backward and its optim_step queued together,
    as ``SharedLearner.train_step`` queues them, then a round trip): the queue, whose step ran in turn, the seconds.
    ``keep_alike_turns``: turns kept as before session 69, whatever the others do."""
    async def main() -> tuple[FairQueue, list[str], float]:
        queue, ran = FairQueue(follow_s=0.2), []
        if keep_alike_turns:
            queue.turns.alike = lambda name: False

        async def user(name: str) -> None:
            costs = random.Random(name)  # steps of one size measure a few ms apart (so one user leads by a sliver)
            for _ in range(loops):
                await asyncio.gather(queue.run(name, name, [step(ran, name, costs.uniform(0.006, 0.014))], follow=True),
                                     queue.run(name, name, [step(ran, name, 0.002)]))
                await asyncio.sleep(0.006)  # the answer's way back and the next call's way in

        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*(user(f"u{i}") for i in range(users)))
        return queue, ran, asyncio.get_running_loop().time() - t0

    return asyncio.run(main())


def test_users_looping_alike_take_turns_without_the_learner_idling_for_any_of_them():
    """Four equal users, each looping one-slice calls with a round trip between them: each loses its turn at its
    round trip as the others do, so no turn is kept for one (it would lead the rest by a sliver: the learner idle
    for its round trip while the others' calls wait, 15-22% of it with eight one-datum users, session 69), and
    they still share the learner evenly. Turns kept regardless (before): the learner idles."""
    queue, ran, seconds = loop_alike(4, 12)
    assert queue.followers.held < 0.05 * seconds, (queue.followers.held, seconds)
    assert sorted(ran[:40].count(f"u{i}") for i in range(4))[0] >= 8, ran[:40]  # even turns while all loop
    kept, _, _ = loop_alike(4, 12, keep_alike_turns=True)
    assert kept.followers.held > 2 * queue.followers.held + 0.02, (kept.followers.held, queue.followers.held)


def test_two_busy_users_share_the_learner_by_time_in_proportion_to_weight():
    """alice's steps cost twice bob's: equal time means bob runs twice as often; with weight 2 alice
    gets twice bob's time."""
    even = run_jobs(FairQueue(), [(0.0, "alice", "a", 12, 0.02), (0.0, "bob", "b", 24, 0.01)])
    first = even[:18]  # while both are busy
    assert 0.6 <= first.count("bob") / first.count("alice") / 2 <= 1.5, first
    weighted = run_jobs(FairQueue({"alice": Share(weight=2.0)}), [(0.0, "alice", "a", 20, 0.01),
                                                                  (0.0, "bob", "b", 20, 0.01)])
    first = weighted[:24]
    assert first.count("alice") >= 1.5 * first.count("bob"), first


def test_a_higher_priority_goes_first_while_it_has_work():
    ran = run_jobs(FairQueue({"ops": Share(priority=1)}), [(0.0, "alice", "a", 5, 0.01), (0.005, "ops", "o", 3, 0.01)])
    assert ran[:4] == ["alice", "ops", "ops", "ops"]


def test_a_user_idle_for_a_while_gets_no_credit_to_hold_the_learner():
    """bob was idle while alice used the learner; when he comes back with many steps they alternate
    with alice's instead of all running first."""
    ran = run_jobs(FairQueue(), [(0.0, "alice", "a", 30, 0.01), (0.15, "bob", "b", 10, 0.01)])
    start = ran.index("bob")
    assert ran[start:start + 8].count("alice") >= 3, ran


def test_a_failing_step_ends_its_job_with_the_error_and_the_queue_goes_on():
    async def main() -> list[str]:
        queue, ran = FairQueue(), []

        async def bad() -> None:
            ran.append("bad")
            raise ValueError("no adapter")

        failing = asyncio.ensure_future(queue.run("alice", "a", [bad, step(ran, "never", 0)]))
        ok = await asyncio.wait_for(queue.run("bob", "b", [step(ran, "bob", 0)]), 1)
        with pytest.raises(ValueError, match="no adapter"):
            await failing
        return ran + ok

    assert asyncio.run(main()) == ["bad", "bob", "bob"]


def test_a_step_that_asks_again_takes_more_turns_and_others_run_between():
    """alice's one step (a sampling call in turns) answers AGAIN four times, then its result: it runs five
    turns, bob's steps sent meanwhile run between them (each waits for one of her turns, not her call), each
    of her turns is charged and counted, and her call's result is the last turn's."""
    from otray.tinker.learner.fair_jobs import AGAIN

    async def main() -> tuple[list[str], object, FairQueue]:
        queue, ran, left = FairQueue(), [], [4]

        async def sampling() -> object:
            ran.append("alice")
            await asyncio.sleep(0.02)
            left[0] -= 1
            return AGAIN if left[0] >= 0 else "samples"

        alice = asyncio.ensure_future(queue.run("alice", "s", [sampling]))
        await asyncio.sleep(0.005)  # her first turn is on the learner
        bobs = [await queue.run("bob", "b", [step(ran, "bob", 0.02)]) for _ in range(3)]
        return ran, (await alice, bobs), queue

    ran, (result, bobs), queue = asyncio.run(main())
    assert result == ["samples"] and bobs == [["bob"]] * 3
    last_bob = len(ran) - 1 - ran[::-1].index("bob")
    assert ran.count("alice") == 5 and ran[1] == "bob"  # bob's first step after her first turn
    assert ("alice", "alice") not in zip(ran[:last_bob], ran[1:last_bob])  # while he waits: one turn of hers at a time
    assert queue.steps["alice"] == 5 and queue.used["alice"] == pytest.approx(0.1, abs=0.05)


def test_a_job_that_fails_early_is_charged_the_steps_it_will_not_run():
    """eve sends 4-step jobs whose first step fails and sends the next at once; bob is busy with steps of the
    same length. eve is charged the three steps she asked for and did not run, so bob runs about four steps
    for each of her attempts (one each if a failing job cost only the step that ran)."""
    async def main() -> list[str]:
        queue, ran = FairQueue(), []

        async def fails() -> None:
            ran.append("eve")
            await asyncio.sleep(0.01)
            raise ValueError("past a limit")

        async def eve() -> None:
            for _ in range(4):
                with pytest.raises(ValueError, match="past a limit"):
                    await queue.run("eve", "e", [fails] + [step(ran, "never", 0.01)] * 3)

        await asyncio.gather(queue.run("bob", "b", [step(ran, "bob", 0.01)] * 24), eve())
        return ran

    ran = asyncio.run(main())
    assert "never" not in ran and ran.count("eve") == 4, ran
    attempts = [i for i, who in enumerate(ran) if who == "eve"]
    between = [b - a - 1 for a, b in zip(attempts, attempts[1:])]
    assert min(between) >= 3, ran


def test_a_shared_call_that_fails_as_a_whole_charges_no_unrun_steps():
    """A shared call fails for all its steps with one error (the pass's, not a user's): each user is charged the
    call's seconds, not also the steps its job will not run."""
    from otray.tinker.learner.fair import Packable

    async def pack(works: list[str]) -> list:
        await asyncio.sleep(0.02)
        if "bad" in works[0]:
            raise RuntimeError("the pass failed")
        return [f"{w} done" for w in works]

    async def main() -> dict[str, float]:
        queue = FairQueue(pack=pack, pass_tokens=1000)
        jobs = [asyncio.ensure_future(queue.run(u, u, [Packable("fb", 10, f"bad {u}")] + [Packable("fb", 10, u)] * 9))
                for u in ("alice", "bob")]
        for j in jobs:
            with pytest.raises(RuntimeError, match="the pass failed"):
                await j
        return {n: u.finish for n, u in queue.users.items()}

    finish = asyncio.run(main())  # each charged half the call's 0.02 s; its nine unrun steps would add ~0.09
    assert set(finish) == {"alice", "bob"} and all(f < 0.05 for f in finish.values()), finish


def test_slices_cut_a_request_at_the_token_budget_and_keep_a_long_datum_whole():
    assert slices([10, 10, 10, 10], 25) == [range(0, 2), range(2, 4)]
    assert slices([30, 5, 5], 25) == [range(0, 1), range(1, 3)]
    assert slices([5] * 3, 100) == [range(0, 3)]
    assert slices([], 10) == []


def test_packable_steps_share_a_call_no_bigger_than_the_chosen_one_and_are_charged_by_tokens():
    """While alice's first slice (200 tokens) runs, bob and carol (16 each), dave (300) queue forward_backward
    slices and erin an optimizer step (another kind). bob is owed the next turn: carol rides with him, alice's
    second slice does not (bigger than bob's: it would make his pass longer); dave's turn then carries alice's
    slice; erin's step goes alone. Each call's seconds are charged to its users by tokens."""
    from otray.tinker.learner.fair import Packable

    calls: list[list[str]] = []

    async def pack(works: list[str]) -> list[str]:
        calls.append(works)
        await asyncio.sleep(0.05)
        return [f"{w} done" for w in works]

    async def main() -> None:
        queue = FairQueue(pack=pack, pass_tokens=1000)
        fb = lambda label, n: Packable("fb", n, label)  # noqa: E731
        alice = asyncio.ensure_future(queue.run("alice", "a", [fb("a1", 200), fb("a2", 200)]))
        await asyncio.sleep(0.01)  # a1 is running alone
        others = [asyncio.ensure_future(queue.run(u, u[0], [s])) for u, s in
                  (("bob", fb("b", 16)), ("carol", fb("c", 16)), ("dave", fb("d", 300)), ("erin", Packable("opt", 1, "e")))]
        assert await alice == ["a1 done", "a2 done"]
        assert [await o for o in others] == [["b done"], ["c done"], ["d done"], ["e done"]]
        assert calls == [["a1"], ["b", "c"], ["d", "a2"], ["e"]], calls
        assert queue.passes == [2, 2]
        assert queue.used["bob"] == pytest.approx(queue.used["carol"])
        a2 = queue.used["alice"] - 0.05  # a1 ran alone for about 0.05 s
        assert queue.used["dave"] / a2 == pytest.approx(300 / 200, rel=0.3)

    asyncio.run(main())


def test_clients_looping_a_step_and_its_optimizer_step_share_every_pass():
    """Six clients each loop a forward_backward slice then its optimizer step, each result reaching its client
    1-5 ms later (a round trip). Left alone they split into cohorts that take turns (about half to a pass,
    24-27 passes for 72 steps before session 43); a pass now waits for the due clients that would ride in it,
    and with optimizer steps first and a shared call waiting for its clients' next jobs (``first_keys``) too:
    all six share almost every pass either way. A seventh client that pauses 0.1 s after each round (longer
    than ``follow_s``) is not waited for."""
    import random

    from otray.tinker.learner.fair import Packable

    async def pack(works: list[str]) -> list[str]:
        await asyncio.sleep(0.004 if works[0] == "opt" else 0.02)
        return works

    async def client(queue: FairQueue, i: int, pause: float) -> None:
        rng = random.Random(i)
        await asyncio.sleep(0.003 * i)  # they come one after another, as users do
        for _ in range(12):
            await queue.run(f"u{i}", f"c{i}", [Packable("fb", 16, "fb")], follow=True)
            await asyncio.sleep(0.001 + 0.004 * rng.random())
            await queue.run(f"u{i}", f"c{i}", [Packable(("optim",), 1, "opt")])
            await asyncio.sleep(pause or 0.001 + 0.004 * rng.random())

    def run(first_keys: tuple, slow: bool = False) -> FairQueue:
        async def main() -> FairQueue:
            queue = FairQueue(pack=pack, pass_tokens=1000, first_keys=first_keys)
            await asyncio.gather(*(client(queue, i, 0.1 if i == 6 else 0.0) for i in range(7 if slow else 6)))
            return queue

        return asyncio.run(main())

    OPTIM = ("optim",)
    assert run(()).packed["fb"]["calls"] <= 15  # 72 steps in 12-13 passes: no cohorts
    assert run((OPTIM,)).packed["fb"]["calls"] <= 15  # 72 steps in 12 passes, after the first one or two
    for first_keys in ((), (OPTIM,)):
        slow = run(first_keys, slow=True)
        assert slow.packed["fb"]["steps"] == 84 and slow.followers.held < 0.3, (slow.packed, slow.followers.held)  # no 50 ms waits


def test_withdrawn_jobs_fail_at_once_and_never_run():
    """A client's queued jobs are withdrawn (its model unloaded): they fail with the reason given and
    their steps never run; the job running now ends with its step; the queue goes on."""
    ran: list[str] = []

    async def main() -> None:
        queue = FairQueue()
        first = asyncio.ensure_future(queue.run("bob", "b", [step(ran, "b1", 0.05), step(ran, "b2", 0.01)]))
        await asyncio.sleep(0.01)  # b1 is running
        later = asyncio.ensure_future(queue.run("bob", "b", [step(ran, "b3", 0.01)]))
        other = asyncio.ensure_future(queue.run("alice", "a", [step(ran, "a1", 0.01)]))
        await asyncio.sleep(0)
        assert queue.withdraw("bob", "b", RuntimeError("unloaded")) == 1
        for job in (first, later):
            with pytest.raises(RuntimeError, match="unloaded"):
                await job
        assert await other == ["a1"]
        await asyncio.sleep(0.06)
        assert ran == ["b1", "a1"] and queue.pending == 0

    asyncio.run(main())


def test_small_steps_run_on_the_side_lane_beside_a_pass_and_never_beside_another_kind_of_step():
    """With a side lane (``side_tokens``): bob's 16-token step, sent while alice's 200-token slice runs, runs
    beside it and ends first; carol's 100-token step (over ``side_tokens``) waits for the main lane. alice's next
    step is not packable (a checkpoint): the side lane closes first, and dave's small step sent during it runs
    after it, not beside it. A small step the main lane chose is not taken by the side lane too: no step runs
    twice; each is charged its seconds."""
    from otray.tinker.learner.fair import Packable

    spans: dict[str, tuple[float, float]] = {}
    loop_time = lambda: asyncio.get_running_loop().time()  # noqa: E731

    def timed(seconds: float):
        async def run(works: list[str]) -> list[str]:
            t0 = loop_time()
            await asyncio.sleep(seconds)
            for w in works:
                assert w not in spans, f"{w} ran twice"
                spans[w] = (t0, loop_time())
            return works
        return run

    saving: list[asyncio.Event] = []

    async def checkpoint() -> str:
        t0 = loop_time()
        saving[0].set()
        await asyncio.sleep(0.1)
        spans["save"] = (t0, loop_time())
        return "save"

    async def main() -> FairQueue:
        saving.append(asyncio.Event())
        queue = FairQueue(pack=timed(0.1), pass_tokens=1000, side=timed(0.02), side_tokens=32)
        assert await queue.run("erin", "e", [Packable("fb", 16, "e1")]) == ["e1"]  # alone: on the main lane, once
        # beside a small step none starts: it would split the next shared pass
        assert queue.side.beside(Packable("fb", 200, "x")) and not queue.side.beside(Packable("fb", 16, "x"))
        alice = asyncio.ensure_future(queue.run("alice", "a", [Packable("fb", 200, "a1"), checkpoint]))
        await asyncio.sleep(0.01)  # a1 is on the learner
        bob = asyncio.ensure_future(queue.run("bob", "b", [Packable("fb", 16, "b1")]))
        carol = asyncio.ensure_future(queue.run("carol", "c", [Packable("fb", 100, "c1")]))
        assert await bob == ["b1"] and not alice.done()
        await saving[0].wait()  # carol's step ran after a1, then alice's checkpoint began
        dave = asyncio.ensure_future(queue.run("dave", "d", [Packable("fb", 16, "d1")]))
        assert await alice == ["a1", "save"] and await carol == ["c1"] and await dave == ["d1"]
        return queue

    queue = asyncio.run(main())
    (a0, a1), (b0, b1), (c0, _) = spans["a1"], spans["b1"], spans["c1"]
    assert a0 < b0 and b1 < a1, spans  # bob beside alice's slice, done before it
    assert c0 >= a1 - 1e-3, spans  # carol's big step waited for the main lane
    s0, s1 = spans["save"]
    assert spans["c1"][1] <= s0 + 1e-3 and spans["d1"][0] >= s1 - 1e-3, spans  # dave's waited for the checkpoint
    assert queue.side.calls["steps"] >= 1 and queue.pending == 0 and not queue.running
    assert queue.used["bob"] == pytest.approx(0.02, abs=0.015)


def test_a_main_lane_call_is_charged_its_seconds_less_those_it_waited_for_side_calls():
    """While a side call computes alone (LaneGate), the main lane's pass waits: those seconds are the side
    call's (charged to its own user), not the main call's user's; the queue reads them from ``paused``."""
    from otray.tinker.learner.fair import Packable

    paused = [0.0]

    async def pack(works: list) -> list:
        await asyncio.sleep(0.12)
        paused[0] += 0.08  # of which the main lane waited this long for a side call
        return works

    async def main() -> FairQueue:
        queue = FairQueue(pack=pack, pass_tokens=1000, paused=lambda: paused[0])
        assert await queue.run("alice", "a", [Packable("fb", 200, "a1")]) == ["a1"]
        return queue

    queue = asyncio.run(main())
    assert queue.used["alice"] == pytest.approx(0.04, abs=0.025)


def test_a_small_user_looping_on_the_side_lane_takes_his_fair_share_not_the_learner():
    """With the main lane paused while a side call runs (LaneGate), a small user looping back to back on the side
    lane would hold the busy user's pass still for as long as he loops. The side lane runs a user's step only
    while his virtual start has not passed the main call's progress (its seconds less its waits): bob and alice
    take turns, about half each, and alice's call ends. Here the main call needs 0.3 s of unpaused time, bob's
    steps take 0.03 s each."""
    from otray.tinker.learner.fair import Packable

    paused, state = [0.0], {"side": False}
    bob_ends: list[float] = []

    async def main_pack(works: list) -> list:  # computes only while no side call runs, as a gated pass
        done, need = 0.0, 0.3 if "a1" in works else 0.03
        while done < need:
            await asyncio.sleep(0.005)
            if state["side"]:
                paused[0] += 0.005
            else:
                done += 0.005
        return works

    async def side_pack(works: list) -> list:
        state["side"] = True
        await asyncio.sleep(0.03)
        state["side"] = False
        bob_ends.append(asyncio.get_running_loop().time())
        return works

    async def scenario() -> tuple[float, float]:
        queue = FairQueue(pack=main_pack, pass_tokens=1000, side=side_pack, side_tokens=32, paused=lambda: paused[0])
        stop = asyncio.Event()

        async def bob() -> None:
            while not stop.is_set():
                await queue.run("bob", "b", [Packable("fb", 16, "b")])

        t0 = asyncio.get_running_loop().time()
        looping = asyncio.ensure_future(bob())
        await asyncio.sleep(0.01)  # bob's first step (the main lane's) is done or on the learner
        alice = queue.run("alice", "a", [Packable("fb", 200, "a1")])
        assert await asyncio.wait_for(alice, 5) == ["a1"]
        took = asyncio.get_running_loop().time() - t0
        stop.set()
        await looping
        return took, queue.used["alice"]

    took, alice_s = asyncio.run(scenario())
    beside = len(bob_ends) * 0.03  # bob's side calls' seconds; alice's call took its 0.3 s plus those
    assert 0.2 <= beside / took <= 0.65 and took < 1.0, (took, len(bob_ends))  # turns about even
    assert alice_s == pytest.approx(0.3, abs=0.1)  # charged her own seconds, not bob's
