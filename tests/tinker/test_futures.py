"""The Tinker service's per-model request order (OrderedExecutor over Futures), without Ray: the SDK
pipelines and parallelises requests, so they may arrive out of order, twice, or never."""

from __future__ import annotations

import asyncio

import pytest

from otray.tinker.config import TinkerScheduling, load_tinker
from otray.tinker.service.futures import Futures, OrderedExecutor, Outcome
from otray.tinker.errors import UserError


def recorder(ran: list[int], seq: int):
    async def run() -> Outcome:
        ran.append(seq)
        return Outcome("json", {"seq": seq})
    return run


def executor(gap_timeout_s: float = 30) -> tuple[Futures, OrderedExecutor]:
    """A model "m"'s request order over fresh futures, with the config's default ``scheduling.calls_ahead``."""
    futures = Futures(60)
    order = OrderedExecutor(futures, gap_timeout_s=gap_timeout_s, ahead=TinkerScheduling().calls_ahead)
    order.start("m")
    return futures, order


def test_requests_run_in_seq_id_order_once_each():
    async def main():
        futures, order = executor(30)
        ran: list[int] = []
        r3 = order.submit("m", 3, "alice", recorder(ran, 3))
        r2 = order.submit("m", 2, "alice", recorder(ran, 2))
        await asyncio.sleep(0.05)
        assert ran == []  # 1 has not come
        r1 = order.submit("m", 1, "alice", recorder(ran, 1))
        assert order.submit("m", 1, "alice", recorder(ran, 1)) == r1  # a resubmission: same request
        outs = [await futures.wait(r, "alice", 5) for r in (r1, r2, r3)]
        assert ran == [1, 2, 3] and [o.body["seq"] for o in outs] == [1, 2, 3]
        with pytest.raises(UserError, match="not|unknown"):
            await futures.wait(r1, "bob", 1)  # another user's request is not there for them
    asyncio.run(main())


def test_a_seq_id_that_never_arrives_fails_after_the_gap_timeout_and_the_rest_run():
    async def main():
        futures, order = executor(0.3)
        ran: list[int] = []
        r2 = order.submit("m", 2, "alice", recorder(ran, 2))
        r3 = order.submit("m", 3, "alice", recorder(ran, 3))
        assert await futures.wait(r2, "alice", 0.1) is None  # still waiting for 1
        assert (await futures.wait(r2, "alice", 5)).body == {"seq": 2}
        assert (await futures.wait(r3, "alice", 5)).body == {"seq": 3}
        assert ran == [2, 3]
        late = order.submit("m", 1, "alice", recorder(ran, 1))  # too late: it gets the gap's failure
        gap = await futures.wait(late, "alice", 1)
        assert gap.kind == "error" and "seq_id 1 never arrived" in gap.body["error"] and ran == [2, 3]
    asyncio.run(main())


def test_forgetting_a_model_fails_its_waiting_requests_with_the_reason():
    async def main():
        futures, order = executor(30)
        r2 = order.submit("m", 2, "alice", recorder([], 2))
        order.forget("m", "its lease was cancelled")
        out = await futures.wait(r2, "alice", 1)
        assert out.kind == "error" and "its lease was cancelled" in out.body["error"]
        with pytest.raises(UserError, match="no model"):
            order.submit("m", 3, "alice", recorder([], 3))
    asyncio.run(main())


class Leader:
    """A run that can lead the request after it (as train_runs.PassRun leads an optim_step)."""

    def __init__(self, ran: list, seq: int, fail: bool = False):
        self.ran, self.seq, self.fail = ran, seq, fail

    async def __call__(self) -> Outcome:
        self.ran.append(self.seq)
        return Outcome("json", {"seq": self.seq})

    def with_next(self, run):
        if not isinstance(run, Follower):
            return None

        async def both() -> tuple[Outcome, Outcome]:
            self.ran.append((self.seq, run.seq))
            if self.fail:
                raise RuntimeError("the shared call failed")
            return Outcome("json", {"seq": self.seq}), Outcome("json", {"seq": run.seq})
        return both


class Follower(Leader):
    def with_next(self, run):
        return None


def test_a_request_runs_with_the_queued_one_it_leads_and_each_gets_its_own_answer():
    async def main():
        futures, order = executor(30)
        ran: list = []
        r2 = order.submit("m", 2, "alice", Follower(ran, 2))
        r3 = order.submit("m", 3, "alice", Leader(ran, 3))  # nothing queued after it: alone
        r1 = order.submit("m", 1, "alice", Leader(ran, 1))  # 2 is queued: 1 and 2 in one call
        outs = [await futures.wait(r, "alice", 5) for r in (r1, r2, r3)]
        assert ran == [(1, 2), 3] and [o.body["seq"] for o in outs] == [1, 2, 3]
        r4 = order.submit("m", 4, "alice", Leader(ran, 4, fail=True))
        await asyncio.sleep(0.05)  # 4 runs alone (5 not there yet)
        r5 = order.submit("m", 5, "alice", Follower(ran, 5))
        r7 = order.submit("m", 7, "alice", Follower(ran, 7))
        r6 = order.submit("m", 6, "alice", Leader(ran, 6, fail=True))  # its shared call fails: both get the error
        outs = [await futures.wait(r, "alice", 5) for r in (r4, r5, r6, r7)]
        assert ran[2:] == [4, 5, (6, 7)]
        assert [o.kind for o in outs] == ["json", "json", "error", "error"]
        assert all("the shared call failed" in o.body["error"] for o in outs[2:])
    asyncio.run(main())


class Sender:
    """A run that may be sent ahead (futures.Ahead, as a training call): ``send`` records that it went; its answer
    comes when the test opens its ``gate``. ``follow``: what ``may_follow`` says; ``step``: it is an optim_step, the
    run before it (``leads``) goes with it as one."""

    def __init__(self, log: list, seq: int, follow: bool = True, leads: bool = False, step: bool = False):
        self.log, self.seq, self.follow, self.leads, self.step = log, seq, follow, leads, step
        self.gate = asyncio.Event()

    def may_follow(self, ahead) -> bool:
        return self.follow

    async def send(self, ahead):
        self.log.append(("sent", self.seq, tuple(r.seq for r in ahead)))

        async def answer() -> Outcome:
            await self.gate.wait()
            return Outcome("json", {"seq": self.seq})
        return answer

    def with_next(self, run):
        if not (self.leads and isinstance(run, Sender) and run.step):
            return None
        pair = Sender(self.log, (self.seq, run.seq))
        pair.gate = self.gate

        async def send(ahead):
            answer = await Sender.send(pair, ahead)

            async def both() -> tuple[Outcome, Outcome]:
                await answer()
                return Outcome("json", {"seq": self.seq}), Outcome("json", {"seq": run.seq})
            return both
        pair.send = send
        return pair

    async def __call__(self) -> Outcome:
        return await (await self.send(()))()


async def ticks(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_training_call_goes_while_the_one_before_is_unanswered_and_answers_stay_in_order():
    """Runs that may go ahead (training calls) are sent up to ``ahead`` unanswered; each is answered only after the one
    before it; a run that may not follow (a restore point is due) and any other request wait until those before
    them are answered."""
    async def main():
        futures, order = executor(30)
        log: list = []
        runs = {s: Sender(log, s) for s in (1, 2, 3)}
        held = Sender(log, 4, follow=False)
        ran: list = []
        ids = [order.submit("m", s, "alice", runs[s]) for s in (1, 2, 3)]
        ids += [order.submit("m", 4, "alice", held), order.submit("m", 5, "alice", recorder(ran, 5))]
        done = lambda k: futures.items[ids[k - 1]].done.is_set()  # noqa: E731
        await ticks()
        assert order.ahead == 2 and log == [("sent", 1, ()), ("sent", 2, (1,))]  # 3 waits: two are unanswered
        runs[1].gate.set()
        await ticks()
        assert done(1) and not done(2) and log[2:] == [("sent", 3, (2,))]
        runs[3].gate.set()
        await ticks()
        assert not done(3)  # its answer is in, but 2 is not answered yet
        assert len(log) == 3 and ran == []  # 4 may not follow 3 (a restore point is due): it waits, and 5 behind it
        runs[2].gate.set()
        await ticks()
        assert done(2) and done(3) and log[3:] == [("sent", 4, ())] and ran == []
        held.gate.set()
        outs = [await futures.wait(r, "alice", 5) for r in ids]
        assert [o.body["seq"] for o in outs] == [1, 2, 3, 4, 5] and ran == [5]
        assert order.sent_ahead == 2
    asyncio.run(main())


def test_a_forward_backward_sent_ahead_waits_for_its_optim_step_to_go_as_one():
    """A run that leads (a forward_backward) with an unanswered run before it waits for its follower (its
    optim_step) and goes with it as one; if the run before is answered first, it goes alone."""
    async def main():
        futures, order = executor(30)
        log: list = []
        first, fb, step = Sender(log, 1), Sender(log, 2, leads=True), Sender(log, 3, step=True)
        ids = [order.submit("m", 1, "alice", first), order.submit("m", 2, "alice", fb)]
        await ticks()
        assert log == [("sent", 1, ())]  # 2 waits for the optim_step that may be on its way
        ids.append(order.submit("m", 3, "alice", step))
        await ticks()
        assert log[1:] == [("sent", (2, 3), (1,))]  # the two as one, sent while 1 is on the learner
        first.gate.set(), fb.gate.set()
        assert [(await futures.wait(r, "alice", 5)).body["seq"] for r in ids] == [1, 2, 3]

        alone = Sender(log, 4, leads=True)
        ids = [order.submit("m", 4, "alice", alone)]
        await ticks()
        assert log[2:] == [("sent", 4, ())]  # nothing before it unanswered: it goes at once, alone
        later = Sender(log, 5, leads=True)
        ids.append(order.submit("m", 5, "alice", later))
        await ticks()
        assert log[3:] == []  # 5 waits for an optim_step or for 4's answer
        alone.gate.set()
        await ticks()
        assert log[3:] == [("sent", 5, ())]  # 4 answered first: 5 goes alone
        later.gate.set()
        assert [(await futures.wait(r, "alice", 5)).body["seq"] for r in ids] == [4, 5]
    asyncio.run(main())


def test_calls_ahead_one_sends_each_run_when_the_last_is_answered_and_zero_is_refused():
    """``scheduling.calls_ahead: 1`` is honoured (each training call waits for the last one's answer) and a value
    below 1 is refused by name."""
    from otray.types import ConfigError

    async def main():
        futures = Futures(60)
        order = OrderedExecutor(futures, gap_timeout_s=30, ahead=1)
        order.start("m")
        log: list = []
        runs = [Sender(log, 1), Sender(log, 2)]
        ids = [order.submit("m", s, "alice", run) for s, run in ((1, runs[0]), (2, runs[1]))]
        await ticks()
        assert log == [("sent", 1, ())]
        runs[0].gate.set()
        await ticks()
        assert log[1:] == [("sent", 2, ())]
        runs[1].gate.set()
        assert [(await futures.wait(r, "alice", 5)).body["seq"] for r in ids] == [1, 2] and order.sent_ahead == 0
    asyncio.run(main())
    assert load_tinker({"scheduling": {"calls_ahead": 1}}).scheduling.calls_ahead == 1
    with pytest.raises(ConfigError, match="scheduling.calls_ahead"):
        load_tinker({"scheduling": {"calls_ahead": 0}})
