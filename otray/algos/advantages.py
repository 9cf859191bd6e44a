"""Group-relative advantages (GRPO family).

Each function takes the rewards of one group (the rollouts of one task, or in
multi-agent games one (game seed, role) pair) and returns one advantage per
rollout. A group whose rewards are all equal gets all-zero advantages.

- ``mean``:   ``A_i = r_i - mean(r)``
- ``zscore``: ``A_i = (r_i - mean(r)) / (std(r) + eps)``  (population std)
- ``rloo``:   ``A_i = r_i - mean_{j != i}(r_j) = n/(n-1) * (r_i - mean(r))``
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from otray.names import ADVANTAGE_NAMES
from otray.types import ConfigError

EPS = 1e-6


def group_mean(rewards: Sequence[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def group_zscore(rewards: Sequence[float]) -> list[float]:
    centered = group_mean(rewards)
    std = math.sqrt(sum(c * c for c in centered) / len(centered))
    return [c / (std + EPS) for c in centered]


def rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    return [n / (n - 1) * c for c in group_mean(rewards)]


ADVANTAGES: dict[str, Callable[[Sequence[float]], list[float]]] = {
    "mean": group_mean,
    "zscore": group_zscore,
    "rloo": rloo,
}


assert tuple(ADVANTAGES) == ADVANTAGE_NAMES, "otray.names.ADVANTAGE_NAMES must list the estimators above"


def compute(name: str, rewards: Sequence[float]) -> list[float]:
    """Advantages of one group with estimator ``name``."""
    try:
        fn = ADVANTAGES[name]
    except KeyError:
        raise ConfigError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ADVANTAGES)}") from None
    return fn(rewards) if rewards else []


def grouped(name: str, rewards: Sequence[float], keys: Sequence[Hashable]) -> list[float]:
    """Advantages where rollouts sharing a key form one group (e.g. (seed, role))."""
    if len(rewards) != len(keys):
        raise ValueError("rewards and keys must have equal length")
    out = [0.0] * len(rewards)
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    for idx in groups.values():
        for i, a in zip(idx, compute(name, [rewards[i] for i in idx])):
            out[i] = a
    return out
