"""RecentLoad: how long a batcher waits before a call for requests on their way (``batch_wait_ms``).

Runs in a Serve replica's process (the ModelServer, or the Gateway in the single layout), on its generate
threads."""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class RecentLoad:
    """The requests in the system (in the call and queued) when each of the last 8 calls ended. Closed-loop
    clients come back after their answer: before a call, :meth:`gather` waits up to ``wait_s`` until as many
    (at most ``most``) are queued; a lone client never waits (its load is 1)."""

    def __init__(self, wait_s: float, most: int):
        self.wait_s, self.most = wait_s, most
        self.ends: deque[int] = deque(maxlen=8)

    def gather(self, arrived: threading.Condition, queued: Callable[[], int]) -> None:
        """Wait on ``arrived`` (held by the caller) until ``queued()`` reaches the recent load, or ``wait_s``."""
        if self.wait_s:
            want = min(self.most, max(self.ends, default=1))
            arrived.wait_for(lambda: queued() >= want, self.wait_s)

    def ended(self, in_system: int) -> None:
        """A call ended with ``in_system`` requests in its call and queued."""
        self.ends.append(in_system)
