"""Envs that fail on purpose, for jobs in tests (named by import path in an admin's config)."""

from __future__ import annotations

from envs.arithmetic import Arithmetic
from otray.env import StepResult


class FailsAfterReset(Arithmetic):
    """Arithmetic whose ``step`` always raises: every episode ends in an ``env_exception`` record."""

    def step(self, action: str) -> StepResult:
        raise RuntimeError("this env fails every step (tests.failing_envs)")
