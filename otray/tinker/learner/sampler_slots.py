"""Which sampler checkpoints the learner holds loaded as read-only adapters, and which adapter a new one goes in.

The :class:`~otray.tinker.learner.adapter_learner.AdapterLearner` samples a sampler checkpoint (a saved adapter
directory) by loading it into an adapter of its model. :class:`SamplerSlots` keeps the bookkeeping: at most
``size`` directories loaded (least recently used given up first), adapters no directory uses kept as spares
and refilled for a directory of the same shape (making an adapter costs ~6x loading weights into one), each
loaded directory's weights version (an inflight target's). An adapter a sampling call in turns is using is *held*
(:meth:`hold`): never given up, refilled or deleted until the call ends, so its later turns decode with the
weights its first had (a directory saved over meanwhile is loaded into another adapter); while calls hold them,
more than ``size`` directories may stay loaded.
:class:`~otray.tinker.learner.learner_sampling.LearnerSampling` does the model's side.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import collections
from typing import Any, Optional


def _shape(spec: Any) -> tuple:
    return spec.rank, spec.alpha, sorted(spec.target_modules())


class SamplerSlots:
    def __init__(self, size: int):
        self.size = size
        self.dirs: collections.OrderedDict[str, str] = collections.OrderedDict()  # dir -> adapter name (LRU)
        self.specs: dict[str, Any] = {}  # sampler adapter name -> its AdapterSpec
        self.spare: list[str] = []  # sampler adapters no dir uses now
        self.versions: dict[str, Optional[int]] = {}  # sampler adapter name -> its weights' version
        self.held: dict[str, int] = {}  # sampler adapter name -> the sampling calls using it now

    def names(self) -> set[str]:
        return set(self.dirs.values())

    def get(self, path: str) -> Optional[str]:
        """The adapter ``path`` is loaded in (now the most recently used), or None."""
        if path in self.dirs:
            self.dirs.move_to_end(path)
            return self.dirs[path]
        return None

    def forget(self, path: str) -> None:
        """``path`` was saved over: what is loaded from it is stale (its adapter becomes a spare)."""
        if path in self.dirs:
            self.spare.append(self.dirs.pop(path))

    def hold(self, name: str) -> None:
        """A sampling call uses adapter ``name`` until its :meth:`release`."""
        self.held[name] = self.held.get(name, 0) + 1

    def release(self, name: str) -> None:
        self.held[name] -= 1
        if not self.held[name]:
            del self.held[name]

    def place(self, spec: Any) -> tuple[Optional[str], list[str]]:
        """Room for a ``spec``-shaped directory: (a spare adapter of its shape to refill, or None for a new
        one; the spare adapters to delete first). Held adapters stay."""
        if len(self.dirs) >= self.size:
            unheld = [path for path, name in self.dirs.items() if name not in self.held]  # least recent first
            if unheld:
                self.spare.append(self.dirs.pop(unheld[0]))
        free = [name for name in self.spare if name not in self.held]
        for name in free:
            if _shape(self.specs[name]) == _shape(spec):
                self.spare.remove(name)
                return name, []
        gone = []
        while free and len(self.spare) + len(self.dirs) >= self.size:
            gone.append(free.pop(0))
            self.spare.remove(gone[-1])
            del self.specs[gone[-1]]
        return None, gone

    def loaded(self, path: str, name: str, spec: Any, version: Optional[int]) -> None:
        self.dirs[path], self.specs[name], self.versions[name] = name, spec, version
