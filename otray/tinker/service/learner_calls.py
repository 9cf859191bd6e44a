"""One base model's training calls on their way to its learner: small ones of many clients coalesced into one.

Every Ray call costs the learner's process about 2 ms of Python (the task, unpickling, the answer) on the one
GIL its passes also need: of a shared cycle of 8 one-datum users (57 ms here), 38 ms were the pass and the
rest those 8 calls, turn by turn (NOTES, issue 53). So a call of at most ``small_tokens`` tokens does not go
alone while ``depth`` coalesced calls are already on the learner: it waits for one of them to end and then goes
with every other call waiting (up to ``small_tokens`` tokens in all) as one :meth:`SharedLearner.calls`, whose
answer list ends together (its members are small, so they share the learner's next pass: no one waits on a big
user). With fewer than ``depth`` on the learner it goes at once, so a lone client never waits here and the
learner always has the next call queued when one ends. A bigger call goes at once, alone (behind its client's
calls still waiting here, if any).

A client may have several calls here (the service sends a model's next training call before its last is answered:
:class:`~otray.tinker.service.futures.OrderedExecutor`). They keep their order: a learner call holds at most one
call of each client, so its next goes in a later learner call, which the learner's queue runs after it.

Clients that loop alike come back from one answer list a few ms apart: the first back would go alone, the next
too, and the rest together, two cohorts taking turns with a pass each (4.4 of 8 users a pass, 36% fewer datums/s
than with no coalescing, NOTES). So before a coalesced call goes it waits, as the learner's fair queue waits for
riders, for the clients answered since the last one went whose next call came within ``follow_s`` last time, up
to twice their last gap (:meth:`Followers.gather`): one call, one pass, a cycle.

Each member stays its own request: its lease check passed before it came here, its model is looked up again
when its call is sent (a model unloaded meanwhile is refused, its rows never sent), it gets its own answer or
exception, and a call lost with its learner reaches every member, whose healing (``Healing.call``, or the
executor's, in order, for a call sent ahead) sends it again.

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
        return await self.submit(call, learner)

    def submit(self, call: LearnerCall, learner: Callable[[], Any]) -> asyncio.Future:
        """``call`` handed over now, behind every call of its client handed over before it (a client may have
        several on their way: the service sends a model's next training call before its last is answered,
        :class:`~otray.tinker.service.futures.OrderedExecutor`); the future of its answer (its result, or the
        exception it raised: not raised). ``learner()`` is asked when the call is sent to the learner, and may
        refuse it then by raising (its model left; its learner died since it was handed over)."""
        answer = asyncio.get_running_loop().create_future()
        if call.tokens() > self.small_tokens and not self._waiting(*call.client()):
            try:
                handle = learner()  # a model no longer live is refused now
            except Exception as e:  # noqa: BLE001 - its answer
                answer.set_exception(e)
                return answer
            self.sent["calls"] += 1
            self.sent["requests"] += 1
            asyncio.ensure_future(self._alone(handle.calls.remote([call]), answer))
            return answer
        self.waiting.append(_Member(call, learner, answer))
        self.followers.arrived(*call.client())
        self._kick()
        return answer

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
        """The waiting calls, as few learner calls as ``small_tokens`` allows, while fewer than ``depth`` are on it:
        each learner call holds at most one call of a client (its next waits for the next learner call, which the
        learner runs after this one: a client's calls keep their order), in the order they came; a call bigger than
        ``small_tokens`` (one that came behind its client's earlier call) goes alone."""
        while self.waiting and self.on_learner < self.depth:
            members, tokens, handle, taken = [], 0, None, set()
            rest: deque[_Member] = deque()
            while self.waiting:
                m = self.waiting.popleft()
                if m.answer.done():  # its request was cancelled while it waited
                    continue
                client, size = m.call.client(), m.call.tokens()
                big = size > self.small_tokens
                if client in taken or (big and members) or (not big and tokens + size > self.small_tokens):
                    taken.add(client)  # its later calls wait too: they stay behind this one
                    rest.append(m)
                    if not big and tokens + size > self.small_tokens:
                        break  # full: the rest wait, in the order they came
                    continue
                try:
                    handle = m.learner()
                except Exception as e:  # noqa: BLE001 - its model left (or its learner died) while it waited: alone
                    m.answer.set_exception(e)
                    taken.add(client)
                    continue
                members.append(m)
                tokens += size
                taken.add(client)
                if big:
                    break
            rest.extend(self.waiting)
            self.waiting = rest
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
            _settle(m.answer, out)
        self._kick()

    @staticmethod
    async def _alone(ref: Any, answer: asyncio.Future) -> None:
        try:
            out = (await ref)[0]
        except Exception as e:  # noqa: BLE001 - the call as a whole (its learner died)
            out = e
        _settle(answer, out)


def _settle(answer: asyncio.Future, out: Any) -> None:
    """``answer`` given ``out`` (an exception: raised by it), unless its request was cancelled."""
    if answer.done():
        return
    if isinstance(out, BaseException):
        answer.set_exception(out)
    else:
        answer.set_result(out)
