"""What the learner's fair queue (:mod:`otray.tinker.learner.fair`) holds: steps, jobs, users, and how a call
is cut into steps and a failed job charged.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable, Iterable, Optional, Sequence, Union

Step = Callable[[], Awaitable[Any]]
Pack = Callable[[list[Any]], Awaitable[list[Any]]]  # works -> a result or an exception each


@dataclass(frozen=True)
class Packable:
    """A step that can share a pass: ``work`` (what ``pack`` takes) of ``tokens`` tokens; only steps of
    equal ``key`` share one."""

    key: Hashable
    tokens: int
    work: Any


class Again:
    """A step's outcome that asks for another turn: the step stays first in its job and runs again in the job's
    next turn, each turn charged as any step (a learner sampling call decoded in turns)."""


AGAIN = Again()


@dataclass
class Job:
    """One call of one client: its steps, run in order, each a turn on the learner."""

    steps: deque  # of Step, those not run yet
    done: asyncio.Future
    arrival: int
    follow: bool  # the client's next job usually comes at once (a forward_backward's optim_step)
    results: list = field(default_factory=list)

    def took(self, outcome: Any) -> list[Union[Step, Packable]]:
        """Its step ran and gave ``outcome`` (a result or an exception); returns the steps an exception left
        unrun (the job ends with it). An :class:`Again` leaves the step to run once more."""
        if isinstance(outcome, Again):
            return []
        if self.steps:  # not withdrawn meanwhile
            self.steps.popleft()
        if not isinstance(outcome, BaseException):
            self.results.append(outcome)
            return []
        left = list(self.steps)
        self.fail(outcome)
        return left

    def fail(self, error: BaseException) -> None:
        """End the job with ``error``: its steps not run yet never run."""
        self.steps.clear()
        if not self.done.done():
            self.done.set_exception(error)


@dataclass
class User:
    finish: float = 0.0  # virtual time: learner seconds used / weight
    clients: dict = field(default_factory=dict)  # client -> deque of its Jobs (insertion order: round robin)


Member = tuple[str, User, str, Job]  # (user, its state, client, the job whose next step is in a call)


def next_steps(users: Iterable[tuple[str, User]], running: set[int], room: int, most: int,
               key: Optional[Hashable] = None) -> list[Member]:
    """In the order of ``users``, each client's next step that can share a call: its job not ``running``, the
    step packable, of pack ``key`` (None: the first one taken's), at most ``most`` tokens, ``room`` in all."""
    out: list[Member] = []
    for n, u in users:
        for c, jobs in u.clients.items():
            step = jobs[0].steps[0] if jobs[0].steps and id(jobs[0]) not in running else None
            if not isinstance(step, Packable) or step.tokens > min(room, most):
                continue
            key = step.key if key is None else key
            if step.key == key:
                out.append((n, u, c, jobs[0]))
                room -= step.tokens
    return out


async def run_call(pack: Optional[Pack], steps: list[Union[Step, Packable]]) -> list[Any]:
    """Run one step, or several packable ones in one ``pack`` call; a result or an exception each."""
    try:
        if isinstance(steps[0], Packable) and pack is not None:
            outcomes = await pack([s.work for s in steps])
            if len(outcomes) != len(steps):
                raise RuntimeError(f"pack gave {len(outcomes)} results for {len(steps)} steps")
            return list(outcomes)
        if isinstance(steps[0], Packable):
            raise RuntimeError("a packable step on a queue without a pack function")
        return [await steps[0]()]
    except Exception as e:  # noqa: BLE001 - the jobs' callers get it
        return [e] * len(steps)


def unrun(steps: Sequence[Union[Step, Packable]], step_s: float, token_s: float) -> float:
    """The learner seconds a failed job's ``steps`` (those it will not run) would have taken, at the failed
    step's price: ``token_s`` a token for a packable step, ``step_s`` for any other. A failed job is charged
    them (not when its step failed with every other of a shared call, one error for all: the call's failure, not
    its user's), so failing early makes a request no cheaper than it asked to be: a user whose large calls fail at
    their first slice (a custom loss stopped by a limit) took a turn per slice, each call sent, deserialized
    and queued in the learner's process, and held another user looping beside it at 2.25x his time alone
    (``benchmarks/custom_loss_bound.py``, issue 54)."""
    return sum(s.tokens * token_s if isinstance(s, Packable) else step_s for s in steps)


def head(steps: Sequence[Union[Step, Packable]]) -> Optional[tuple[Hashable, int]]:
    """A job's first step as :class:`~otray.tinker.learner.followers.Followers` keeps it: (pack key, tokens)."""
    return (steps[0].key, steps[0].tokens) if steps and isinstance(steps[0], Packable) else None


def slices(lengths: Sequence[int], slice_tokens: int) -> list[range]:
    """Consecutive index ranges over items of ``lengths`` tokens, each at most ``slice_tokens`` tokens
    (an item longer than that alone): how a forward_backward is cut into steps."""
    out, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > slice_tokens:
            out.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out
