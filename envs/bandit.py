"""Bandit: data-free, single-turn. Pick one of K labelled arms.

Arm ``i`` pays 1 with probability ``probs[i]`` (fixed by the env's kwargs, unknown
to the policy), drawn with the episode's seed. The policy answers with an arm
label; ``info["regret"]`` is ``max(probs) - probs[chosen]`` (the best arm's payoff
when no valid label was given). GRPO should learn to pick the best arm.
"""

from __future__ import annotations

import random
import re
from typing import Any

from otray.env import Env, StepResult, register
from otray.types import EnvStateError, Task


class Bandit(Env):
    max_turns = 1

    def __init__(self, probs: list[float] | tuple[float, ...] = (0.2, 0.5, 0.8, 0.35),
                 labels: str = "ABCDEFGHIJ", system_prompt: str | None = None):
        if not probs or any(not 0.0 <= p <= 1.0 for p in probs) or len(probs) > len(labels):
            raise ValueError(f"Bandit probs must be 1..{len(labels)} values in [0, 1], got {probs}")
        self.probs, self.labels = list(probs), labels[: len(probs)]
        self.system_prompt = system_prompt
        self._rng: random.Random | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._rng = random.Random(seed if seed is not None else task.data.get("seed", 0))
        return f"Pick an arm: {', '.join(self.labels)}.", {}

    def step(self, action: str) -> StepResult:
        if self._rng is None:
            raise EnvStateError("Bandit.step called before reset (or after the episode ended)")
        rng, self._rng = self._rng, None
        picks = re.findall(rf"\b([{self.labels}])\b", action.upper())
        best = max(self.probs)
        if not picks:
            return StepResult("", 0.0, True, {"regret": best, "parse_error": True, "correct": False})
        arm = self.labels.index(picks[-1])
        reward = 1.0 if rng.random() < self.probs[arm] else 0.0
        return StepResult("", reward, True, {"arm": arm, "regret": best - self.probs[arm], "parse_error": False,
                                             "correct": self.probs[arm] == best})


register("bandit", Bandit)
