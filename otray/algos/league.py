"""League play: a pool of a trained policy's own past snapshots to play against, and how one is drawn.

tinker-cookbook reports that plain self-play on tic-tac-toe collapses into a degenerate equilibrium
(steps 80-110) and proposes fixed opponents or frozen copies as the cure. A league is both: every
``every`` steps the job saves a checkpoint and adds it to the trained policy's pool (the newest
``max_size`` are kept); each step some seeds are played against an opponent from the pool or from
the league's fixed opponents (``game.league``, see :class:`otray.config.LeagueSection`).

Which snapshot (:meth:`LeaguePool.sample`): prioritised fictitious self-play, AlphaStar's "hard"
weighting. Each snapshot's weight is ``(1 - p) ** 2``, where ``p`` is the current policy's score
against it so far (1 a win, 0.5 a draw, 0 a loss), smoothed as ``(score + 1) / (games + 2)`` so an
unplayed snapshot counts as even (weight 0.25). Snapshots the policy still loses to are drawn most;
ones it beats every time fade out but never vanish (a policy that forgets how to beat them
meets them again). ``priority: uniform`` draws every snapshot alike.

The pool is plain data (:meth:`LeaguePool.state`): the game job keeps it in its checkpointed state,
and each snapshot is a checkpoint directory of the job, so a resumed job has the same league.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

PRIORITIES = ("hard", "uniform")


@dataclass
class Snapshot:
    """One past version of the policy: the step it was taken at and its checkpoint's model directory."""

    step: int
    model_dir: str
    games: int = 0  # games the current policy played against it
    score: float = 0.0  # the current policy's summed score in them

    @property
    def label(self) -> str:
        return f"step-{self.step}"

    def learner_score(self) -> float:
        """The current policy's smoothed mean score against this snapshot."""
        return (self.score + 1.0) / (self.games + 2.0)


@dataclass
class LeaguePool:
    max_size: int = 8
    priority: str = "hard"
    snapshots: list[Snapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_size < 1:
            raise ValueError(f"a league pool holds at least one snapshot, got max_size={self.max_size}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"league priority must be one of {PRIORITIES}, got {self.priority!r}")

    def add(self, step: int, model_dir: str) -> None:
        """Snapshot taken at ``step``; the oldest goes when the pool is full."""
        if any(s.step == step for s in self.snapshots):
            return  # the same step again (a resumed job re-saving it): keep its record
        self.snapshots.append(Snapshot(step, model_dir))
        del self.snapshots[:-self.max_size]

    def weights(self) -> list[float]:
        if self.priority == "uniform":
            return [1.0] * len(self.snapshots)
        return [(1.0 - s.learner_score()) ** 2 for s in self.snapshots]

    def sample(self, rng: random.Random) -> Snapshot | None:
        """A snapshot drawn by the priority rule; None while the pool is empty."""
        if not self.snapshots:
            return None
        return rng.choices(self.snapshots, weights=self.weights())[0]

    def record(self, step: int, scores: list[float]) -> None:
        """The current policy's scores (1 / 0.5 / 0) in games against the snapshot of ``step``."""
        for s in self.snapshots:
            if s.step == step:
                s.games += len(scores)
                s.score += sum(scores)

    def state(self) -> dict[str, Any]:
        return {"max_size": self.max_size, "priority": self.priority, "snapshots": [asdict(s) for s in self.snapshots]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "LeaguePool":
        return cls(state["max_size"], state["priority"], [Snapshot(**s) for s in state["snapshots"]])
