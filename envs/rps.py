"""Repeated rock-paper-scissors: a simultaneous-move game as a PettingZoo ``ParallelEnv``.

Two agents, ``player_0`` and ``player_1``, pick rock (0), paper (1) or scissors (2)
at the same time for ``rounds`` rounds (default 5). Each round the winner gets +1
and the loser -1 (0 each on a tie), so rewards sum to zero. An agent observes the
opponent's previous move (3 = none yet). Factories as in PettingZoo:
``parallel_env()`` and ``env()`` (the AEC version, through ``parallel_to_aec``).

Text side: :func:`render_text` and :func:`parse_move` (``<move>rock</move>``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv
from pettingzoo.utils import parallel_to_aec

from otray.games import GameText

MOVES = ("rock", "paper", "scissors")
NONE = 3


def parallel_env(**kwargs: Any) -> ParallelEnv:
    return parallel_raw_env(**kwargs)


def env(**kwargs: Any):
    return parallel_to_aec(parallel_env(**kwargs))


class parallel_raw_env(ParallelEnv):  # noqa: N801 - PettingZoo's naming convention
    metadata = {"render_modes": ["ansi"], "name": "rps_v0"}

    def __init__(self, rounds: int = 5, render_mode: str | None = None):
        if rounds < 1:
            raise ValueError(f"rps needs rounds >= 1, got {rounds}")
        self.rounds, self.render_mode = rounds, render_mode
        self.possible_agents = ["player_0", "player_1"]
        self.agents: list[str] = []
        self.round = 0
        self._obs_space, self._act_space = spaces.Discrete(4), spaces.Discrete(3)  # one object each, as PettingZoo asks

    def observation_space(self, agent: str) -> spaces.Space:
        return self._obs_space

    def action_space(self, agent: str) -> spaces.Space:
        return self._act_space

    def reset(self, seed: int | None = None, options: dict | None = None):
        self.agents = list(self.possible_agents)
        self.round = 0
        self.history: list[tuple[int, int]] = []
        return {a: np.int64(NONE) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, int]):
        a, b = (int(actions[p]) for p in self.possible_agents)
        self.round += 1
        self.history.append((a, b))
        outcome = 0 if a == b else (1 if (a - b) % 3 == 1 else -1)  # paper beats rock, etc.
        rewards = {"player_0": float(outcome), "player_1": float(-outcome)}
        done = self.round >= self.rounds
        observations = {"player_0": np.int64(b), "player_1": np.int64(a)}  # Discrete's own type (api_test)
        terminations = {p: done for p in self.agents}
        truncations = {p: False for p in self.agents}
        infos = {p: {"round": self.round} for p in self.agents}
        if done:
            self.agents = []
        return observations, rewards, terminations, truncations, infos

    def render(self) -> str:
        return "\n".join(f"round {i + 1}: {MOVES[a]} vs {MOVES[b]}" for i, (a, b) in enumerate(self.history))

    def close(self) -> None:
        pass


def render_text(observation: int, agent: str) -> str:
    last = "none yet" if int(observation) == NONE else MOVES[int(observation)]
    return f"Rock, paper or scissors? Your opponent's last move: {last}. Reply as <move>rock</move>."


_MOVE = re.compile(r"<move>\s*(rock|paper|scissors)\s*</move>", re.IGNORECASE)


def parse_move(text: str) -> int | None:
    found = _MOVE.findall(text)
    return MOVES.index(found[-1].lower()) if found else None


def always_rock(observation: int, agent: str) -> int:
    """A scripted opponent a policy can learn to beat (paper)."""
    return 0


TEXT = GameText(render=render_text, parse=parse_move, example="<move>scissors</move>")
