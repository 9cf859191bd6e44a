"""otray: reinforcement learning for LLM agents, everything a Ray actor.

The public surface: the driver API (``connect``, ``Client``, ``JobHandle``), configs,
the env protocol, and the data types.
"""

from otray.client import Client, JobHandle, connect
from otray.config import Config
from otray.config import load as load_config
from otray.env import Env, StepResult, TaskSource, check_env, register
from otray.types import (ConfigError, Datum, OtrayError, SamplingParams, Task, Trajectory,
                         TrajectoryGroup)

__all__ = ["connect", "Client", "JobHandle", "Config", "load_config", "Env", "StepResult", "TaskSource", "check_env", "register", "ConfigError",
           "Datum", "OtrayError", "SamplingParams", "Task", "Trajectory", "TrajectoryGroup"]
