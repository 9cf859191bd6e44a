"""How soon each Tinker client's next job follows its last, and what it brings: the clients the fair queue
waits for before a shared pass (:meth:`~otray.tinker.learner.fair.FairQueue._await_riders`) and after one
(``wait_for_followers``: :meth:`~otray.tinker.learner.fair.FairQueue._gather`).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable, Hashable, Optional, Sequence


class Followers:
    """How soon each client's next job follows its last (from one job's end to the next one's arrival): the
    clients a shared call waits for (:meth:`FairQueue._gather`), how long a turn is kept for a client's next
    job (:meth:`window`), and the learner's waits for jobs to arrive (:meth:`wait`)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()  # set by every new job (a held turn waits for one: :meth:`wait`)
        self.held = 0.0  # seconds the learner was kept idle waiting for jobs (:meth:`wait`)
        self.ended: dict[tuple[str, str], float] = {}  # (user, client) -> when its last job ended
        self.gap: dict[tuple[str, str], float] = {}  # (user, client) -> the seconds its last next job took to come
        self.heads: dict[tuple[str, str], deque] = {}  # (user, client) -> its last two jobs' (key, tokens)

    def arrived(self, user: str, client: str, head: Optional[tuple[Hashable, int]] = None) -> None:
        """A job of ``client`` arrived; ``head``: its first step's (pack key, tokens), None if not packable."""
        end = self.ended.pop((user, client), None)
        if end is not None:
            self.gap[(user, client)] = time.monotonic() - end
        self.heads.setdefault((user, client), deque(maxlen=2)).append(head)
        self.event.set()

    async def wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``done()`` (checked again at each job's arrival) or the monotonic ``deadline``, whichever
        comes first: whether ``done()`` came true. The learner is idle meanwhile: the time counts in ``held``."""
        t0 = time.monotonic()
        try:
            while not done():
                self.event.clear()
                try:
                    await asyncio.wait_for(self.event.wait(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    return False
            return True
        finally:
            self.held += time.monotonic() - t0

    def window(self, user: str, client: str, within: float) -> Optional[float]:
        """How long to keep a turn for ``client``'s next job: up to twice the gap its last one came after (and
        ``within``); None when that gap was longer than ``within`` (or there was none yet)."""
        gap = self.gap.get((user, client))
        return None if gap is None or gap > within else min(within, 2 * gap + 0.002)

    def riders(self, head: tuple[Hashable, int], room: int, within: float,
               can_ride: Callable[[tuple[str, str]], bool]) -> dict[tuple[str, str], float]:
        """The clients (those ``can_ride`` lets) whose next job is due, their last one having ended less than
        twice their last gap ago (and ``within``), and likely rides on ``head``: of its key and about its size
        (half to all of its tokens, within ``room`` together), as the job before their last was (a loop of a
        forward_backward and its optim_step alternates); each with the monotonic time it is due by."""
        now, out = time.monotonic(), {}
        for c, end in self.ended.items():
            gap, heads = self.gap.get(c), self.heads.get(c)
            if gap is None or gap > within or heads is None or len(heads) < 2 or heads[0] is None:
                continue
            (key, tokens), due = heads[0], end + min(within, 2 * gap + 0.002)
            if due > now and key == head[0] and head[1] / 2 <= tokens <= min(room, head[1]) and can_ride(c):
                out[c] = due
                room -= tokens
        return out

    def finished(self, user: str, client: str) -> None:
        self.ended[(user, client)] = time.monotonic()

    def forget(self, user: str, client: str) -> None:
        self.ended.pop((user, client), None)
        self.gap.pop((user, client), None)
        self.heads.pop((user, client), None)

    async def gather(self, clients: Sequence[tuple[str, str]], within: float,
                     queued: Callable[[str, str], bool]) -> tuple[list[tuple[str, str]], float]:
        """Wait for the next jobs of those ``clients`` whose next job came within ``within`` seconds last time (until
        ``queued(user, client)``), up to twice the slowest of their gaps (and ``within``): those that did not come,
        and the seconds waited (nothing when none is due)."""
        soon = self.soon(clients, within)
        if not soon:
            return [], 0.0
        t0 = time.monotonic()
        missing = lambda: [c for c in soon if not queued(*c)]  # noqa: E731
        if await self.wait(lambda: not missing(), t0 + min(within, 2 * max(soon.values()) + 0.002)):
            return [], time.monotonic() - t0
        return missing(), time.monotonic() - t0

    def soon(self, clients: Sequence[tuple[str, str]], within: float) -> dict[tuple[str, str], float]:
        """Those of ``clients`` whose next job came within ``within`` seconds last time, with that gap."""
        return {c: self.gap[c] for c in clients if self.gap.get(c, within + 1.0) <= within}
