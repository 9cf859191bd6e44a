"""One asyncio event loop per process on a daemon thread, for synchronous env code that drives async
libraries (the MCP SDK's clients, a verifiers environment's rollout): coroutines are submitted with
:func:`submit` and waited on by the env's own thread, with a time limit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's background loop (started on first use; its thread is a daemon)."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="otray-async", daemon=True).start()
        return _loop


def submit(coro: Coroutine[Any, Any, Any]) -> Future:
    """Run ``coro`` on the background loop; the returned future is waited on from any thread."""
    return asyncio.run_coroutine_threadsafe(coro, event_loop())
