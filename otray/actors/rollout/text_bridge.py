"""PettingZoo game <-> what an LLM agent sees and says.

A bridge wraps one PettingZoo game and turns each decision into text:
``prompt(agent)`` renders the agent's observation (a per-game ``render`` function, or
the generic fallback that lists legal action indices) and ``act(agent, reply)``
parses the reply (a per-game ``parse`` function, or ``<move>N</move>``). Legal moves
come from the observation's ``action_mask`` (the classic-games convention) or, without
one, from a ``Discrete`` action space. ``waiting()`` names the agents that must decide
now: in an ``AECEnv`` (:class:`TextBridge`) the one whose turn it is, in a
``ParallelEnv`` (:class:`ParallelTextBridge`) every live agent that has not chosen
this round; the parallel env steps once all of them have chosen.

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
from dataclasses import dataclass, field
from typing import Any

from otray.games import GameText, legal_actions


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
    action: int | str | None = None  # str: a reply handed whole to a game that judges replies
    observation: str = ""


def bridge_for(env: Any, text: GameText, rules: MoveRules, seed: int) -> "Bridge":
    """Reset ``env`` with ``seed`` and wrap it in the bridge for its API (AEC or Parallel)."""
    from pettingzoo import ParallelEnv

    if isinstance(env, ParallelEnv):
        observations, _ = env.reset(seed=seed)
        return ParallelTextBridge(env, text, rules, seed, observations)
    env.reset(seed=seed)
    return TextBridge(env, text, rules, seed)


@dataclass
class Bridge:
    """What both bridges share: the text, the illegal-move rule, counts and summed rewards."""

    env: Any
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

    # per API: the observation, the turn check, applying a legal action, who must decide now
    def observation(self, agent: str) -> Any:
        raise NotImplementedError

    def _check_turn(self, agent: str) -> None:
        raise NotImplementedError

    def _apply(self, agent: str, action: Any) -> None:
        raise NotImplementedError

    def waiting(self) -> list[str]:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.forfeited is not None or not self.env.agents

    @property
    def judged(self) -> bool:
        """The game reads replies itself (``judges_replies``, e.g. a TextArena game): replies go to it whole,
        it applies its own invalid-move rule and flags each invalid reply in ``infos[agent]["invalid_move"]``."""
        return bool(getattr(getattr(self.env, "unwrapped", self.env), "judges_replies", False))

    def legal(self, agent: str) -> list[Any]:
        """The legal actions: the action mask, else every action of a Discrete space (a game that judges
        replies: the moves it lists, ``legal_moves(agent)``)."""
        if self.judged:
            return list(self.env.unwrapped.legal_moves(agent))
        legal = legal_actions(self.observation(agent))
        if not legal and hasattr(self.env.action_space(agent), "n"):
            legal = list(range(int(self.env.action_space(agent).n)))
        return legal

    def prompt(self, agent: str) -> str:
        return self.text.render(self.observation(agent), agent)

    def play(self, agent: str, action: int) -> Decision:
        """Apply an action chosen without text (scripted and random policies); it must be legal."""
        self._check_turn(agent)
        action = action if isinstance(action, str) else int(action)  # numpy integers from scripted policies
        if action not in self.legal(agent):
            raise ValueError(f"{agent} chose action {action}, which is not legal here")
        self._apply(agent, action)
        return Decision("played", action)

    def act(self, agent: str, reply: str) -> Decision:
        """Apply ``agent``'s reply to the game (``agent`` must be one of ``waiting()``)."""
        self._check_turn(agent)
        if self.judged:
            self._apply(agent, self.text.parse(reply))
            if self.env.infos.get(agent, {}).get("invalid_move"):
                self.counts[agent]["illegal"] += 1
            return Decision("played", reply)
        legal = self.legal(agent)
        try:
            action = self.text.parse(reply)
        except Exception:  # noqa: BLE001 - a parser bug must not end the game
            action = None
        if action is not None and action in legal:
            self.retries.pop(agent, None)
            self._apply(agent, action)
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
            self._apply(agent, action)
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


@dataclass
class TextBridge(Bridge):
    """An ``AECEnv`` (reset already called): one agent decides at a time. An agent's observation is read once
    per env step (a decision renders it, checks the reply against its legal moves, and a scripted policy
    reads it: one ``observe`` through the wrappers, not three); policies must not change it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._seen: dict[str, Any] = {}  # agent -> its observation since the last env step

    def observation(self, agent: str) -> Any:
        if agent not in self._seen:
            self._seen[agent] = self.env.observe(agent)
        return self._seen[agent]

    def _check_turn(self, agent: str) -> None:
        if self.env.agent_selection != agent:
            raise ValueError(f"it is {self.env.agent_selection}'s turn, not {agent}'s")

    def _apply(self, agent: str, action: int) -> None:
        self._seen.clear()
        self.env.step(action)
        for a, r in self.env.rewards.items():  # rewards of this step, for every agent
            self.totals[a] += float(r)

    def waiting(self) -> list[str]:
        env = self.env
        while env.agents and (env.terminations[env.agent_selection] or env.truncations[env.agent_selection]):
            env.step(None)  # PettingZoo's way to step a finished agent out
            self._seen.clear()
        return [] if self.done else [env.agent_selection]


@dataclass
class ParallelTextBridge(Bridge):
    """A ``ParallelEnv``: every live agent chooses each round; the env steps when all have."""

    observations: dict[str, Any] = field(default_factory=dict)  # from reset, then from each step

    def __post_init__(self) -> None:
        super().__post_init__()
        self.chosen: dict[str, int] = {}

    def observation(self, agent: str) -> Any:
        return self.observations[agent]

    def _check_turn(self, agent: str) -> None:
        if agent not in self.env.agents or agent in self.chosen:
            raise ValueError(f"{agent} is not waiting to move (live: {self.env.agents}, chosen: {sorted(self.chosen)})")

    def _apply(self, agent: str, action: int) -> None:
        self.chosen[agent] = action
        if set(self.chosen) >= set(self.env.agents):
            observations, rewards, _, _, _ = self.env.step(dict(self.chosen))
            self.chosen = {}
            self.observations.update(observations)
            for a, r in rewards.items():
                self.totals[a] += float(r)

    def waiting(self) -> list[str]:
        return [] if self.done else [a for a in self.env.agents if a not in self.chosen]
