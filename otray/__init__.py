"""otray: reinforcement learning for LLM agents, everything a Ray actor.

The public surface so far: configs, the env protocol, and the data types. The
driver API (``connect``, ``Client``, ``JobHandle``) arrives with the Ray runtime.
"""

from otray.config import Config
from otray.config import load as load_config
from otray.env import Env, StepResult, TaskSource, check_env, register
from otray.types import (ConfigError, Datum, OtrayError, SamplingParams, Task, Trajectory,
                         TrajectoryGroup)

__all__ = ["Config", "load_config", "Env", "StepResult", "TaskSource", "check_env", "register", "ConfigError",
           "Datum", "OtrayError", "SamplingParams", "Task", "Trajectory", "TrajectoryGroup"]
