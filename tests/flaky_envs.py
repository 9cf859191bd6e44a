"""Envs that misbehave on purpose, importable by path from job configs in tests."""

from envs.arithmetic import Arithmetic
from otray.env import StepResult


class SometimesRaises(Arithmetic):
    """Raises in ``step`` for every task whose answer is odd."""

    def reset(self, task, seed=None):
        self._odd = int(task.data["answer"]) % 2 == 1
        return super().reset(task, seed)

    def step(self, action):
        if self._odd:
            raise ValueError("odd answers are not supported by this env")
        return super().step(action)


class Unparseable(Arithmetic):
    def step(self, action):
        super().step(action)
        return StepResult("", 0.0, True, {"parse_error": True})
