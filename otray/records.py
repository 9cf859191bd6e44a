"""What the control plane answers, typed: the way ``otray.types`` types the data plane.

The ResourceManager returns these dataclasses (never string-keyed dicts) to the client, the CLI and
the dashboard; ``JobStatus.to_json()`` is the one JSON shape of a job (``otray status``, ``/api``).
A learner checkpoint's ``meta.json`` is a :class:`CheckpointMeta`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class JobState(str, enum.Enum):
    """A job's lifecycle: ``QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED``."""

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        """The job has ended (the one definition: every caller asks this)."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


@dataclass(frozen=True)
class JobStatus:
    """One job as its owner (or an admin) sees it."""

    id: str
    owner: str
    name: str
    state: JobState
    error: str | None
    kind: str  # rl | sft | infer | tinker
    total_steps: int | None
    progress: dict[str, Any] = field(default_factory=dict)  # the latest metrics row (keys: otray.metric_keys)
    created: float = 0.0
    started: float | None = None
    finished: float | None = None
    waiting: str | None = None  # a QUEUED job: why it has not started (the scheduler's words)
    recoveries: list[str] = field(default_factory=list)  # failures healed by a restart: "step N: Type: message"

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def succeeded(self) -> bool:
        return self.state is JobState.SUCCEEDED

    def to_json(self) -> dict[str, Any]:
        """A plain JSON object (``state`` as its name)."""
        return {**asdict(self), "state": self.state.value}


@dataclass(frozen=True)
class UserInfo:
    name: str
    admin: bool


@dataclass(frozen=True)
class Identity:
    """Who a key belongs to, and whether the cluster checks keys at all."""

    name: str
    admin: bool
    auth_enabled: bool


@dataclass(frozen=True)
class ServableJob:
    """A job of the caller's with checkpoints that ``otray serve`` can load."""

    id: str
    created: float
    model_path: str
    steps: list[int]


@dataclass(frozen=True)
class EpisodePage:
    """The episodes a job logged at one step, and every step that has some."""

    steps: list[int]
    episodes: list[dict[str, Any]]


@dataclass(frozen=True)
class MetricsPage:
    """A job's metrics rows after a cursor (``Job.metrics_after``), and the cursor to ask from next. Rows keep the
    order they were written in; a restart's rewind drops the rows past its checkpoint, and the steps it runs
    again come after the cursor as new rows, so a follower sees them (reading by count, it skipped them)."""

    rows: list[dict[str, Any]]
    cursor: int


@dataclass
class CheckpointMeta:
    """A learner checkpoint's ``meta.json``: where its counters stand and what it holds.

    ``sharded``: the number of ranks that wrote it (0: a single learner's ``trainable.pt``);
    ``optimizer``: whether a sharded one holds AdamW state; ``extra_state``: the job's own data
    (the data position, a league's pool)."""

    step: int
    version: int
    lora: dict[str, Any]
    model_path: str
    extra_state: dict[str, Any] = field(default_factory=dict)
    sharded: int = 0
    optimizer: bool = True

    @property
    def lora_rank(self) -> int:
        return int(self.lora.get("rank", 0))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMeta:
        known = {k: data[k] for k in ("step", "version", "lora", "model_path", "extra_state", "sharded",
                                      "optimizer") if k in data}
        known["sharded"] = int(known.get("sharded") or 0)
        known["optimizer"] = bool(known.get("optimizer", True))
        return cls(**known)
