"""The Tinker service's per-model request order (OrderedExecutor over Futures), without Ray: the SDK
pipelines and parallelises requests, so they may arrive out of order, twice, or never."""

from __future__ import annotations

import asyncio

import pytest

from otray.tinker.service.futures import Futures, OrderedExecutor, Outcome
from otray.tinker.errors import UserError


def recorder(ran: list[int], seq: int):
    async def run() -> Outcome:
        ran.append(seq)
        return Outcome("json", {"seq": seq})
    return run


def executor(gap_timeout_s: float = 30) -> tuple[Futures, OrderedExecutor]:
    """A model "m"'s request order over fresh futures."""
    futures = Futures(60)
    order = OrderedExecutor(futures, gap_timeout_s=gap_timeout_s)
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
