"""Calling envs concurrently, each call with a time limit: what keeps a slow or hung env from
stalling a whole batch.

Env calls (``reset``, ``step``, ``close``) are blocking Python calls, often waiting on the
network (an OpenReward server, a sandbox). :func:`call_all` runs a phase's calls on threads,
at most ``EnvIO.max_concurrency`` at a time per env, and gives up on a call that runs past
``EnvIO.timeout_s`` (an :class:`EnvTimeout` in its place; the call's thread is a daemon and
is left behind, since Python cannot stop a thread). With one call at a time and no limit,
calls run inline on the caller's thread, exactly as a plain loop would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class EnvTimeout(TimeoutError):
    """An env call ran past its time limit."""


@dataclass(frozen=True)
class EnvIO:
    """How one env's calls run: ``max_concurrency`` at a time, each within ``timeout_s`` seconds, an
    episode's env calls within ``episode_timeout_s`` in all (None: no limit)."""

    max_concurrency: int = 1
    timeout_s: float | None = None
    episode_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("timeout_s", "episode_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 (or None for no limit), got {value}")


def _run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - returned, the caller turns it into an error record
        return e


def call_all(calls: Sequence[tuple[Callable[[], Any], EnvIO, float | None]]) -> list[Any]:
    """Run every ``(fn, io, limit_s)``: at most ``io.max_concurrency`` at once among the calls sharing
    that ``io``, each given ``limit_s`` seconds from its start (None: no limit). Returns each call's
    value, or the exception it raised, or an :class:`EnvTimeout`, in the order of ``calls``."""
    if all(io.max_concurrency == 1 and limit is None for _, io, limit in calls):
        return [_run(fn) for fn, _, _ in calls]  # serial, on this thread
    results: list[Any] = [None] * len(calls)
    done = [threading.Event() for _ in calls]
    gates: dict[int, threading.Semaphore] = {}
    for _, io, _ in calls:
        gates.setdefault(id(io), threading.Semaphore(io.max_concurrency))
    started: list[float | None] = [None] * len(calls)
    released, lock = [False] * len(calls), threading.Lock()

    def release(i: int) -> None:  # once per call: by the call, or for it when it is abandoned
        with lock:
            if not released[i]:
                released[i] = True
                gates[id(calls[i][1])].release()

    def worker(i: int, fn: Callable[[], Any]) -> None:
        gates[id(calls[i][1])].acquire()
        started[i] = time.monotonic()
        value = _run(fn)
        release(i)
        with lock:
            if not done[i].is_set():
                results[i] = value
                done[i].set()

    for i, (fn, _, _) in enumerate(calls):
        threading.Thread(target=worker, args=(i, fn), daemon=True, name=f"env-call-{i}").start()
    while not all(d.is_set() for d in done):
        now = time.monotonic()
        for i, (_, _, limit) in enumerate(calls):
            t0 = started[i]
            if limit is not None and t0 is not None and now - t0 > limit:
                with lock:
                    if not done[i].is_set():
                        results[i] = EnvTimeout(f"the env call took longer than {limit:g} s; it was abandoned")
                        done[i].set()
                release(i)  # a hung call gives its slot to the calls still waiting
        next((d for d in done if not d.is_set()), done[0]).wait(0.01)
    return results
