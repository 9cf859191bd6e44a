"""CoinFlip: a reward that does not depend on skill, for throughput benchmarks.

The reward is one bit of the reply's SHA-256 (1.0 or 0.0): deterministic, about half
the replies of a group earn it, so groups have non-zero advantages and every step
trains on every token, even with a randomly initialized model. Tasks come from the
arithmetic dataset (``envs.arithmetic:make_dataset``); only ``question`` is used.
"""

from __future__ import annotations

import hashlib
from typing import Any

from otray.env import Env, StepResult, register
from otray.types import EnvStateError, Task


def coin(text: str) -> float:
    return float(hashlib.sha256(text.encode()).digest()[0] & 1)


class CoinFlip(Env):
    max_turns = 1

    def __init__(self) -> None:
        self._live = False

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._live = True
        return str(task.data["question"]), {}

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise EnvStateError("CoinFlip.step called before reset (or after the episode ended)")
        self._live = False
        return StepResult("", coin(action), True, {})


register("coin_flip", CoinFlip)
