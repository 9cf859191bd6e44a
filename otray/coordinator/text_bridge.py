"""PettingZoo game <-> what an LLM agent sees and says.

A :class:`TextBridge` wraps a PettingZoo ``AECEnv`` whose observations are dicts
with an ``action_mask`` (the classic-games convention) and turns each decision into
text: ``prompt(agent)`` renders the observation (a per-game ``render`` function, or
the generic fallback that lists legal action indices) and ``act(agent, reply)``
parses the reply (a per-game ``parse`` function, or ``<move>N</move>``).

The rule for illegal or unparseable moves (:class:`MoveRules`): the agent gets an
error observation and may retry up to ``max_retries`` times; after that the bridge
either plays a uniformly random legal move for it (``on_exhausted="random"``) or
the agent forfeits (``"forfeit"``: the game ends, the forfeiting agent gets
``forfeit_reward`` and every other agent ``-forfeit_reward``). Each outcome is
counted per agent in :attr:`TextBridge.counts` (``illegal``, ``random_moves``,
``forfeits``) for the job's metrics.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MOVE_INDEX = re.compile(r"<move>\s*(\d+)\s*</move>")


def legal_actions(observation: Any) -> list[int]:
    """Indices the action mask allows (every action when there is no mask)."""
    mask = observation.get("action_mask") if isinstance(observation, dict) else None
    return [] if mask is None else [int(i) for i in np.flatnonzero(mask)]


def generic_render(observation: Any, agent: str) -> str:
    """Fallback renderer: the raw observation and the legal action indices."""
    obs = observation.get("observation") if isinstance(observation, dict) else observation
    legal = legal_actions(observation)
    return (f"You are {agent}. Observation: {np.asarray(obs).tolist()}\n"
            f"Legal moves: {', '.join(map(str, legal))}. Reply with one as <move>N</move>.")


def generic_parse(text: str) -> int | None:
    found = _MOVE_INDEX.findall(text)
    return int(found[-1]) if found else None


@dataclass
class GameText:
    """The per-game text functions: ``render(observation, agent) -> str``, ``parse(reply) -> action | None``."""

    render: Callable[[Any, str], str] = generic_render
    parse: Callable[[str], int | None] = generic_parse


@dataclass
class MoveRules:
    max_retries: int = 2
    on_exhausted: str = "random"  # random | forfeit
    forfeit_reward: float = -1.0

    def __post_init__(self) -> None:
        if self.on_exhausted not in ("random", "forfeit"):
            raise ValueError(f"MoveRules.on_exhausted must be 'random' or 'forfeit', got {self.on_exhausted!r}")


@dataclass
class Decision:
    """What happened to one reply: ``played`` (an action was applied), ``retry`` (say
    ``observation`` to the agent and ask again), ``random`` (a random legal move was
    played for it) or ``forfeit`` (the game is over)."""

    kind: str
    action: int | None = None
    observation: str = ""


@dataclass
class TextBridge:
    env: Any  # a PettingZoo AECEnv (reset already called)
    text: GameText = field(default_factory=GameText)
    rules: MoveRules = field(default_factory=MoveRules)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.retries: dict[str, int] = {}
        self.counts: dict[str, dict[str, int]] = {a: {"illegal": 0, "random_moves": 0, "forfeits": 0}
                                                  for a in self.env.possible_agents}
        self.forfeited: str | None = None
        self.totals: dict[str, float] = {a: 0.0 for a in self.env.possible_agents}

    def _step(self, action: int) -> None:
        self.env.step(action)
        for a, r in self.env.rewards.items():  # rewards of this step, for every agent
            self.totals[a] += float(r)

    def prompt(self, agent: str) -> str:
        return self.text.render(self.env.observe(agent), agent)

    def play(self, agent: str, action: int) -> Decision:
        """Apply an action chosen without text (scripted and random policies); it must be legal."""
        if self.env.agent_selection != agent:
            raise ValueError(f"it is {self.env.agent_selection}'s turn, not {agent}'s")
        legal = legal_actions(self.env.observe(agent))
        if legal and action not in legal:
            raise ValueError(f"{agent} chose action {action}, which the action mask forbids")
        self._step(action)
        return Decision("played", action)

    def act(self, agent: str, reply: str) -> Decision:
        """Apply ``agent``'s reply to the game (it must be ``agent``'s turn)."""
        if self.env.agent_selection != agent:
            raise ValueError(f"it is {self.env.agent_selection}'s turn, not {agent}'s")
        legal = legal_actions(self.env.observe(agent))
        try:
            action = self.text.parse(reply)
        except Exception:  # noqa: BLE001 - a parser bug must not end the game
            action = None
        if action is not None and (not legal or action in legal):
            self.retries.pop(agent, None)
            self._step(action)
            return Decision("played", action)
        self.counts[agent]["illegal"] += 1
        used = self.retries.get(agent, 0)
        if used < self.rules.max_retries:
            self.retries[agent] = used + 1
            why = "could not read a move" if action is None else f"move {action} is not legal"
            return Decision("retry", observation=f"Invalid move: {why}. Try again.\n{self.prompt(agent)}")
        self.retries.pop(agent, None)
        if self.rules.on_exhausted == "random" and legal:
            self.counts[agent]["random_moves"] += 1
            action = self.rng.choice(legal)
            self._step(action)
            return Decision("random", action)
        self.counts[agent]["forfeits"] += 1
        self.forfeited = agent
        return Decision("forfeit")

    def rewards(self) -> dict[str, float]:
        """Each agent's summed rewards, or the forfeit rule's outcome."""
        if self.forfeited is not None:
            return {a: (self.rules.forfeit_reward if a == self.forfeited else -self.rules.forfeit_reward)
                    for a in self.env.possible_agents}
        return dict(self.totals)
