"""The fair queue's side lane: small steps on a second compute thread, beside a pass.

With one compute thread, a small user's step that arrives while a busy user's slice runs waits for it: on 2
cores, beside 256-token slices of the tiny model, a one-datum user pausing between steps took 2.5-2.7x his time
alone (``benchmarks/learner_fairness.py``), and smaller slices cost the busy user her throughput. With
``scheduling.side_tokens`` > 0, while the main lane (:class:`~otray.tinker.learner.fair.FairQueue`) runs a
packable step bigger than that (a busy user's slice), the next small packable steps of other clients (at most
``side_tokens`` tokens a call, of one pack key, in fair order) run on the side lane's thread beside it, one call
at a time, charged their seconds like any step. Beside a
small packable step the lane starts no call (small steps share the main lane's next pass). Shared passes route
rows per thread (:class:`~otray.tinker.learner.mixed_lora.RowRouting`) and touch only their own adapters'
parameters, so the two lanes' passes give what each gives alone (tests/tinker/test_mixed_passes.py). While a
side call runs, the main lane's pass waits at its next LoRA layer (:class:`~otray.tinker.learner.lane_gate.LaneGate`):
the two threads share the GIL, and side by side a small pass took 3x its time alone (with the gate a pausing
one-datum user's step beside 256-token slices is 1.0-1.2x his time alone, the busy user keeping 97-104%: session
64). A user is taken only while his virtual start has not passed the main call's progress, so one looping back to
back gets his fair share of the learner, not all of it. The lane
closes, its call ending first, before any step that is not packable (a sample, a checkpoint, an adapter made or
dropped: they change or read the model as a whole).

It computes on one more core: a learner whose torch threads fill its CPUs would oversubscribe them.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional, Protocol, Union

from otray.tinker.learner.fair_jobs import Member, Pack, Packable, Step, User, next_steps, run_call


class Queue(Protocol):
    """What the side lane reads and calls of its :class:`~otray.tinker.learner.fair.FairQueue`."""

    users: dict[str, User]
    running: set[int]
    vtime: float

    def order_key(self, nu: tuple[str, User]) -> tuple: ...

    async def call(self, members: list[Member], run: Callable[[], Awaitable[list[Any]]], main: bool = True) -> None: ...

    def fail_all(self, error: Exception) -> None: ...


class SideLane:
    """The side lane of ``queue`` (which owns it, on the learner actor's event loop): ``run`` takes a call's
    works on the second compute thread; calls hold at most ``tokens`` tokens (0: the lane is off)."""

    def __init__(self, queue: Queue, run: Optional[Pack], tokens: int, paused: Callable[[], float] = lambda: 0.0):
        self.queue, self.run, self.tokens = queue, run, tokens if run is not None else 0
        self.paused = paused  # seconds the main lane has waited for side calls since the start (LaneGate)
        self.main_step: Optional[tuple[float, float, float]] = None  # the main call now: start, paused(), weight
        self.open = False  # the main lane runs a packable step: the side lane may run beside it
        self.task: Optional[asyncio.Task] = None
        self.stepped = asyncio.Event()  # set after each call (the main lane waits on it when all work is here)
        self.retrying = False  # a kick is due later (:meth:`_later`)
        self.calls = {"calls": 0, "steps": 0}

    def beside(self, step: Union[Step, Packable]) -> bool:
        """Whether the lane may start calls beside the main lane's ``step``: a packable one bigger than a side call
        (beside a small one the small steps ride in the next shared pass: a lane of its own would split it; N = 8
        one-datum users then made 1.80x one pass per user's throughput, against 2.11x in shared passes alone)."""
        return self.tokens > 0 and isinstance(step, Packable) and step.tokens > self.tokens

    def members(self) -> list[Member]:
        """The next call: small packable steps of clients not on the learner, in fair order, of the first one's
        key, up to ``tokens`` tokens in all; of users whose virtual start has not passed the main lane's call's
        progress (:meth:`progress`: a user ahead of it waits until it catches up, :meth:`kick` then)."""
        q = self.queue
        limit = self.progress()
        return next_steps(sorted(((n, u) for n, u in q.users.items() if u.clients and max(q.vtime, u.finish) <= limit),
                                 key=q.order_key), q.running, self.tokens, self.tokens)

    def progress(self) -> float:
        """The virtual time the main lane's call has reached: ``V`` plus its seconds so far, less its waits for side
        calls, over its user's weight (``V`` between calls). Only a user whose virtual start has not passed it gets
        a side call, so a small user looping back to back beside a busy one takes his fair share, not the learner
        (the main lane waits while a side call runs: with the gate and no limit he took 58% and she kept 18%)."""
        if self.main_step is None:
            return self.queue.vtime
        t0, paused, weight = self.main_step
        return self.queue.vtime + max(time.monotonic() - t0 - (self.paused() - paused), 0.0) / weight

    def main_starts(self, weight: float) -> None:
        """The main lane's call (of a user of ``weight``) starts: :meth:`progress` reads how far it has got."""
        self.main_step = (time.monotonic(), self.paused(), weight)

    def main_ends(self) -> float:
        """The main lane's call ended: the seconds it waited for side calls (theirs: not charged to it)."""
        _, paused, _ = self.main_step or (0.0, self.paused(), 1.0)
        self.main_step = None
        return self.paused() - paused

    def kick(self) -> None:
        """Start the lane if it is open, idle, and has work (or, when the fair order holds its work back, once the
        main lane's call has caught up: :meth:`_later`)."""
        if self.open and (self.task is None or self.task.done()):
            if self.members():
                self.task = asyncio.get_running_loop().create_task(self._calls())
            else:
                self._later()

    def _later(self) -> None:
        """Kick again when the main lane's call reaches the earliest virtual start of a user held back (one timer
        at a time; the main call's seconds over its user's weight are virtual time)."""
        q = self.queue
        limit = self.progress()
        held = next_steps([(n, u) for n, u in q.users.items() if u.clients and max(q.vtime, u.finish) > limit],
                          q.running, self.tokens, self.tokens)  # steps the lane would take but for the fair order
        if held and self.open and not self.retrying:
            self.retrying = True
            first = min(max(q.vtime, m[1].finish) for m in held)
            weight = self.main_step[2] if self.main_step is not None else 1.0
            asyncio.get_running_loop().call_later((first - limit) * weight + 1e-3, self._retry)

    def _retry(self) -> None:
        self.retrying = False
        self.kick()

    async def _calls(self) -> None:
        """Calls while the lane is open and has work (each member's job settled as the main lane's are)."""
        try:
            while self.open and (members := self.members()):
                steps = [m[3].steps[0] for m in members]
                self.calls["calls"] += 1
                self.calls["steps"] += len(members)
                await self.queue.call(members, lambda: run_call(self.run, steps), main=False)
                self.stepped.set()
            self._later()
        except Exception as e:  # a fault of the queue itself: every waiting caller learns it (none hangs)
            self.queue.fail_all(e)
            raise
        finally:
            self.stepped.set()

    async def call_ends(self) -> None:
        """Wait for the call now running here (there must be one: every waiting job is on it)."""
        if self.task is None or self.task.done():
            raise RuntimeError("the fair queue has jobs waiting and none it can run")
        self.stepped.clear()
        await self.stepped.wait()

    async def close(self) -> None:
        """Close the lane and wait for its call now running to end."""
        self.open = False
        if self.task is not None and not self.task.done():
            await asyncio.shield(self.task)
