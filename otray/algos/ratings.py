"""Elo ratings over every player a game job has evaluated: trained policies, checkpoints, fixed opponents.

The classic sequential Elo update, one game at a time. Player ``a`` rated ``R_a`` meets ``b``
rated ``R_b``; ``a``'s expected score is

    E_a = 1 / (1 + 10 ** ((R_b - R_a) / 400))

and after the game, scored ``S_a`` (1 win, 0.5 draw, 0 loss; ``S_b = 1 - S_a``),

    R_a += k * (S_a - E_a)        R_b += k * (S_b - E_b)

Players enter at ``initial``. An *anchor* (by default ``random``, the uniformly random
player every game job can evaluate against) never moves: it pins the scale, so 1000 means
"as strong as random play" in every job and figures from different jobs can be set side by
side. Games that ended without a result (a timeout, a failed call) are not rated.

The table is plain data (:meth:`EloTable.state` / :meth:`EloTable.from_state`): the game job
keeps it in its checkpointed state, so ratings survive a resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otray.metric_keys import ELO_PREFIX


def expected_score(rating: float, other: float) -> float:
    """The probability-like score a player rated ``rating`` is expected to take from one rated ``other``."""
    return 1.0 / (1.0 + 10.0 ** ((other - rating) / 400.0))


@dataclass
class EloTable:
    k: float = 16.0
    initial: float = 1000.0
    anchor: str | None = "random"
    ratings: dict[str, float] = field(default_factory=dict)
    games: dict[str, int] = field(default_factory=dict)  # rated games per player

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise ValueError(f"Elo k must be positive, got {self.k}")

    def rating(self, player: str) -> float:
        return self.ratings.get(player, self.initial)

    def record(self, player: str, opponent: str, score: float) -> None:
        """One game between ``player`` and ``opponent``; ``score`` is the player's (1, 0.5 or 0)."""
        if player == opponent:
            raise ValueError(f"a player cannot be rated against itself ({player!r})")
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"a game's score is 1 (win), 0.5 (draw) or 0 (loss), got {score}")
        ra, rb = self.rating(player), self.rating(opponent)
        ea = expected_score(ra, rb)
        for name, new in ((player, ra + self.k * (score - ea)), (opponent, rb + self.k * (ea - score))):
            self.ratings[name] = self.initial if name == self.anchor else new
            self.games[name] = self.games.get(name, 0) + 1

    def record_all(self, player: str, opponent: str, scores: list[float]) -> None:
        for s in scores:
            self.record(player, opponent, s)

    def metrics(self, prefix: str = ELO_PREFIX) -> dict[str, float]:
        """``elo/<player>`` for every rated player, rounded to a tenth of a point."""
        return {prefix + name: round(r, 1) for name, r in sorted(self.ratings.items())}

    def state(self) -> dict[str, Any]:
        return {"k": self.k, "initial": self.initial, "anchor": self.anchor,
                "ratings": dict(self.ratings), "games": dict(self.games)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "EloTable":
        return cls(state["k"], state["initial"], state["anchor"], dict(state["ratings"]), dict(state["games"]))


def game_score(reward: float) -> float:
    """A game's Elo score from the player's final reward: won (> 0) 1, drew (0) 0.5, lost (< 0) 0."""
    return 1.0 if reward > 0 else 0.5 if reward == 0 else 0.0
