"""One base model's training calls on their way to its learner: small ones of many clients coalesced into one.

Every Ray call costs the learner's process about 2 ms of Python (the task, unpickling, the answer) on the one
GIL its passes also need: of a shared cycle of 8 one-datum users (57 ms here), 38 ms were the pass and the
rest those 8 calls, turn by turn (NOTES, issue 53). So a call of at most ``small_tokens`` tokens does not go
alone while ``depth`` coalesced calls are already on the learner: it waits for one of them to end and then goes
with every other call waiting (up to ``small_tokens`` tokens in all) as one :meth:`SharedLearner.calls`, whose
answer list ends together (its members are small, so they share the learner's next pass: no one waits on a big
user). With fewer than ``depth`` on the learner it goes at once, so a lone client never waits here and the
learner always has the next call queued when one ends. A bigger call always goes at once, alone.

Clients that loop alike come back from one answer list a few ms apart: the first back would go alone, the next
too, and the rest together, two cohorts taking turns with a pass each (4.4 of 8 users a pass, 36% fewer datums/s
than with no coalescing, NOTES). So before a coalesced call goes it waits, as the learner's fair queue waits for
riders, for the clients answered since the last one went whose next call came within ``follow_s`` last time, up
to twice their last gap (:meth:`Followers.gather`): one call, one pass, a cycle.

Each member stays its own request: its lease check passed before it came here, its model is looked up again
when its call is sent (a model unloaded meanwhile is refused, its rows never sent), it gets its own answer or
exception, and a call lost with its learner reaches every member, whose healing (``Healing.call``) sends it
again.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from otray.tinker.learner.calls import LearnerCall
from otray.tinker.learner.followers import Followers

DEPTH = 2  # coalesced calls on a learner at once: one running, the next queued behind it


@dataclass
class _Member:
    call: LearnerCall
    learner: Callable[[], Any]  # the model's learner handle; raises when the model left (Training.learner_of)
    answer: asyncio.Future


class LearnerCalls:
    """The calls of one base model's learner (``small_tokens``: the most tokens a coalesced call holds, 0: every
    call alone; ``depth``: coalesced calls on the learner at once; ``follow_s``: how long the next coalesced call
    waits, at most, for the members of the last one whose next call came that fast last time). ``sent`` counts
    learner calls and requests."""

    def __init__(self, small_tokens: int, depth: int = DEPTH, follow_s: float = 0.05):
        self.small_tokens, self.depth, self.follow_s = small_tokens, depth, follow_s
        self.waiting: deque[_Member] = deque()
        self.on_learner = 0  # coalesced calls sent and not yet answered
        self.followers = Followers()  # how soon each client's next call follows its last answer
        self.expected: list[tuple[str, str]] = []  # the members of the calls answered since the last one went
        self.going: Optional[asyncio.Task] = None  # :meth:`_go`, while it runs
        self.sent = {"calls": 0, "requests": 0}

    async def send(self, call: LearnerCall, learner: Callable[[], Any]) -> Any:
        """``call``'s answer (its result; its exception raised) from the learner ``learner()`` names."""
        handle = learner()  # a model no longer live is refused now
        if call.tokens() > self.small_tokens:
            self.sent["calls"] += 1
            self.sent["requests"] += 1
            return _answer((await handle.calls.remote([call]))[0])
        member = _Member(call, learner, asyncio.get_running_loop().create_future())
        self.waiting.append(member)
        self.followers.arrived(*call.client())
        self._kick()
        return _answer(await member.answer)

    def forget(self, user: str, client: str) -> None:
        """``client`` (a model id) left: its gaps are no longer kept or waited for."""
        self.followers.forget(user, client)

    def _kick(self) -> None:
        """The waiting calls go now when no client answered since the last one went is due back (a lone client: no
        task hop), else once those are back (:meth:`_go`)."""
        if not self.waiting or self.on_learner >= self.depth or (self.going is not None and not self.going.done()):
            return
        if all(self._waiting(*c) for c in self.followers.soon(self.expected, self.follow_s)):
            self.expected = []
            self._take()
        else:
            self.going = asyncio.ensure_future(self._go())

    async def _go(self) -> None:
        """While fewer than ``depth`` coalesced calls are on the learner, the waiting calls go, once the clients
        answered since the last went are back (those that came back within ``follow_s`` last time, waited for up
        to twice that: :meth:`Followers.gather`), so clients that loop alike share one call, and so the learner's
        next pass, instead of splitting into calls taking turns."""
        while self.waiting and self.on_learner < self.depth:
            expected, self.expected = self.expected, []
            await self.followers.gather(expected, self.follow_s, self._waiting)
            self._take()

    def _waiting(self, user: str, client: str) -> bool:
        return any(m.call.client() == (user, client) for m in self.waiting)

    def _take(self) -> None:
        """The waiting calls, as few learner calls as ``small_tokens`` allows, while fewer than ``depth`` are on it."""
        while self.waiting and self.on_learner < self.depth:
            members, tokens, handle = [], 0, None
            while self.waiting and tokens + self.waiting[0].call.tokens() <= self.small_tokens:
                m = self.waiting.popleft()
                if m.answer.done():  # its request was cancelled while it waited
                    continue
                try:
                    handle = m.learner()
                except Exception as e:  # noqa: BLE001 - its model left while it waited: refused alone
                    m.answer.set_exception(e)
                    continue
                members.append(m)
                tokens += m.call.tokens()
            if members:
                self.on_learner += 1
                self.sent["calls"] += 1
                self.sent["requests"] += len(members)
                asyncio.ensure_future(self._call(handle, members))

    async def _call(self, handle: Any, members: list[_Member]) -> None:
        try:
            outs = await handle.calls.remote([m.call for m in members])
        except Exception as e:  # noqa: BLE001 - the call as a whole (its learner died): every member's answer
            outs = [e] * len(members)
        finally:
            self.on_learner -= 1
        for m, out in zip(members, outs):
            self.followers.finished(*m.call.client())
            self.expected.append(m.call.client())
            if not m.answer.done():
                m.answer.set_result(out)
        self._kick()


def _answer(out: Any) -> Any:
    if isinstance(out, BaseException):
        raise out
    return out
