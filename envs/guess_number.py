"""Guess the number: data-free, multi-turn.

The env hides a number in ``[low, high]`` (drawn from ``task.data["seed"]``, so all
rollouts of one GRPO group play the same game) and answers each guess with
"higher", "lower" or "correct". Finding it on turn ``t`` of ``max_turns`` earns
``1 - penalty * (t - 1)`` (more for fewer turns); not finding it earns 0. A reply
without a number in range gets a reminder and counts in ``info["invalid_guesses"]``.

Tasks need no dataset: ``dataset.generator: otray.env:seed_task`` draws them.
"""

from __future__ import annotations

import random
import re
from typing import Any

from otray.env import Env, StepResult, atomic_write, dataset_paths, register
from otray.types import EnvStateError, Task

_INT = re.compile(r"-?\d+")


class GuessNumber(Env):
    def __init__(self, low: int = 1, high: int = 16, max_turns: int = 5, penalty: float = 0.1,
                 system_prompt: str | None = None):
        if not low < high:
            raise ValueError(f"GuessNumber needs low < high, got {low}..{high}")
        self.low, self.high, self.max_turns, self.penalty = low, high, max_turns, penalty
        self.system_prompt = system_prompt
        self._target: int | None = None
        self._turn = 0
        self._invalid = 0

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._target = random.Random(task.data.get("seed", task.id)).randint(self.low, self.high)
        self._turn, self._invalid = 0, 0
        return f"Guess my number ({self.low}-{self.high}).", {}

    def step(self, action: str) -> StepResult:
        if self._target is None:
            raise EnvStateError("GuessNumber.step called before reset (or after the episode ended)")
        self._turn += 1
        found = _INT.findall(action)
        guess = int(found[-1]) if found else None
        info = {"turns": self._turn, "invalid_guesses": self._invalid, "target": self._target}
        if guess == self._target:
            self._target = None
            return StepResult("", max(0.0, 1.0 - self.penalty * (self._turn - 1)), True, {**info, "correct": True})
        if guess is None or not self.low <= guess <= self.high:
            self._invalid += 1
            info["invalid_guesses"] = self._invalid
            obs = f"Answer with one number from {self.low} to {self.high}."
        else:
            obs = "higher" if guess < self._target else "lower"
        if self._turn >= self.max_turns:
            self._target = None
            return StepResult("", 0.0, True, {**info, "correct": False})
        return StepResult(obs, 0.0, False, info)


def binary_search_dialogue(target: int, low: int = 1, high: int = 16) -> list[dict[str, str]]:
    """A demonstration: the conversation of an optimal player (for SFT warm-ups)."""
    msgs = [{"role": "user", "content": f"Guess my number ({low}-{high})."}]
    lo, hi = low, high
    while True:
        guess = (lo + hi) // 2
        msgs.append({"role": "assistant", "content": str(guess)})
        if guess == target:
            return msgs
        if guess < target:
            lo = guess + 1
            msgs.append({"role": "user", "content": "higher"})
        else:
            hi = guess - 1
            msgs.append({"role": "user", "content": "lower"})


def make_chat_dataset(out_dir: str, *, seed: int = 0, num_train: int = 4000, num_eval: int = 200, low: int = 1,
                      high: int = 16) -> dict[str, Any]:
    """Binary-search demonstrations as chat JSONL (train/eval), for an SFT warm-up."""
    import json

    paths, built = dataset_paths(out_dir, {"train": "chat_train.jsonl", "eval": "chat_eval.jsonl"})
    if built:
        return paths
    rng = random.Random(seed)
    for split, n in (("train", num_train), ("eval", num_eval)):
        with atomic_write(paths[split]) as f:
            for i in range(n):
                msgs = binary_search_dialogue(rng.randint(low, high), low, high)
                f.write(json.dumps({"id": f"gn-{split}-{i}", "messages": msgs}) + "\n")
    return paths


register("guess_number", GuessNumber)
