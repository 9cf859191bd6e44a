"""Epochs: how a process that caches the ResourceManager's answers learns, cheaply, that one may have changed.

The Tinker gateway asks the manager on every request whether the caller's key still holds, and the Tinker service
asks whether a training client's lease still holds: a Ray call each (~0.5 ms of the caller's CPU and as much of
the manager's), four to six per SDK step. Their answers change only when a key is deleted or rotated, or a lease
ends (a job token dropped: cancelled, closed, its holder gone), and such a change must hold from the caller's very
next request (docs/security.md). So the manager keeps an *epoch* per kind of answer in the cluster's GCS
key-value store and sets it to a new random value whenever an answer of that kind may have changed, before the
call that changed it answers (:func:`bump`; and when it starts: its job tokens are new then). A cache keeps an
answer with the epoch it read *before* asking (:func:`read`, one GCS read, ~0.2 ms of the reader's CPU) and uses it
while the epoch reads the same; a change after that read is a new epoch, so no answer outlives a change, and a
cache that missed nothing needs no message from the manager. Without an epoch in the store (no manager of this
version) :func:`read` gives None and callers ask every time.

Runs in the ResourceManager (:func:`bump`), the Tinker gateway's replicas and the TinkerService (:func:`read`)."""

from __future__ import annotations

import secrets
from typing import Any, Awaitable, Callable, Hashable, Optional

KEYS = b"otray:epoch:keys"  # users' API keys: deleted or rotated
LEASES = b"otray:epoch:leases"  # job tokens (a Tinker lease's): dropped
_NAMESPACE = "otray"


def bump(*names: bytes) -> None:
    """A new epoch for each of ``names``: every answer cached under the old one is asked again. (Outside a Ray
    cluster nothing can cache these answers: nothing to do.)"""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return
    for name in names:
        internal_kv._internal_kv_put(name, secrets.token_bytes(8), overwrite=True, namespace=_NAMESPACE)


def read(name: bytes) -> Optional[bytes]:
    """The epoch of ``name`` now, or None when none was set (or the store does not answer): cache nothing."""
    from ray.experimental import internal_kv

    try:
        return internal_kv._internal_kv_get(name, namespace=_NAMESPACE)
    except Exception:  # noqa: BLE001 - no GCS to ask: nothing may be cached
        return None


class EpochCache:
    """Answers of one kind (``name``'s) that held, each kept with the epoch read before it was asked. Bounded:
    past ``limit`` entries it starts over."""

    def __init__(self, name: bytes, limit: int = 10_000):
        self.name, self.limit = name, limit
        self.kept: dict[Hashable, tuple[bytes, Any]] = {}
        self.asked = 0  # answers asked of the manager (not taken from here)

    async def answer(self, key: Hashable, ask: Callable[[], Awaitable[Any]]) -> Any:
        """The answer kept for ``key`` while the epoch reads as it did when it was asked, else ``ask()``'s (kept
        when true; a false answer, or an exception, is asked again next time)."""
        epoch = read(self.name)  # before asking: a change after this read is a new epoch
        got = self.kept.get(key)
        if got is not None and epoch is not None and got[0] == epoch:
            return got[1]
        self.asked += 1
        answer = await ask()
        if answer and epoch is not None:
            if len(self.kept) >= self.limit:
                self.kept.clear()
            self.kept[key] = (epoch, answer)
        return answer
