"""ProtocolCoordinator: phase-synchronized multi-agent games over PettingZoo envs.

G games run at once. A *phase* is one synchronized tick over all live games: in an
``AECEnv`` the agent whose turn it is has a pending decision, in a ``ParallelEnv``
every live agent that has not chosen yet this round (so all of them act in the same
phase); decisions are grouped by policy; every model policy answers its whole group
with **one** batched generate call, scripted and random policies answer directly;
every reply is applied through the game's bridge
(:mod:`otray.actors.rollout.text_bridge`: parsing, the illegal-move rule). Phases
repeat until every game has ended.

Policies (:class:`Policy`): ``model`` (rollout worker handles, a trained policy's or a
frozen checkpoint's, which the coordinator routes over with a
:class:`~otray.actors.sampling.fleet.RolloutFleet` of its own; or, in process, any
generate function), ``scripted`` (``fn(observation, agent) ->
action``) or ``random`` (a uniformly random legal move). Each agent played by a
model gets its own multi-turn trajectory, exactly as the single-agent loop builds
them: its prompt and every later observation are mask 0, only the tokens it
sampled are mask 1 (with the sampler's logprobs); it never sees another agent's
observation. Its reward is its PettingZoo reward for the game; ``info`` holds the
agent's counts for the game (``illegal``, ``random_moves``, ``forfeits``) and
``illegal_replies``, the unreadable or illegal replies in that trajectory itself
(with ``context="turn"``, one trajectory per decision: 0 or 1 without retries), and, given a
``move_reward`` function (reward shaping: ``fn(observation, agent, action) -> float`` for each
legal move a model chose, on the observation it chose from), ``move_reward``, their sum.

``policies`` is either keyed by agent (every game seats the same policies) or a
library keyed by policy name, with a *seating* (agent -> policy name) per game given
to :meth:`ProtocolCoordinator.run`. The class is plain Python; game jobs run it as a
Ray actor (``ray.remote(ProtocolCoordinator)``, see ``otray/actors/job/game_source.py``), so the
games' envs live in the coordinator's process and only dataclasses cross.
"""

from __future__ import annotations

import inspect
import math
import random
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from otray.actors.rollout.agent_loop import ChatContinuation, GenerateFn, Limits
from otray.actors.sampling.fleet import RolloutFleet
from otray.actors.rollout.text_bridge import Bridge, Decision, MoveRules, bridge_for
from otray.games import GameText
from otray.types import ErrorRecord, FinishReason, SamplingParams, Task, Trajectory


Opening = int | Sequence[Any]  # random plies, or the actions to replay (``ProtocolCoordinator.run``)


@dataclass
class Policy:
    """How an agent decides: ``kind`` is ``model``, ``scripted`` or ``random``."""

    kind: str
    name: str = ""
    generate: GenerateFn | None = None  # model, in process: a generate function
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=16))  # model
    fn: Callable[..., Any] | None = None  # scripted: fn(observation, agent[, rng=...]) -> action
    workers: tuple[Any, ...] = ()  # model, as an actor: rollout worker handles (the coordinator's fleet)

    def __post_init__(self) -> None:
        if self.kind not in ("model", "scripted", "random"):
            raise ValueError(f"policy kind must be model, scripted or random, got {self.kind!r}")
        if self.kind == "model" and self.generate is None and not self.workers:
            raise ValueError(f"model policy {self.name!r} needs rollout worker handles or a generate function")
        if self.kind == "scripted" and self.fn is None:
            raise ValueError(f"scripted policy {self.name!r} needs fn(observation, agent) -> action")
        self.name = self.name or self.kind
        self.takes_rng = self.fn is not None and "rng" in inspect.signature(self.fn).parameters


@dataclass
class GameResult:
    seed: int
    rewards: dict[str, float]
    moves: list[tuple[str, int | str]]  # (agent, action) in the order played (a judged game's: the reply)
    trajectories: dict[str, Trajectory]  # agents played by a model policy
    counts: dict[str, dict[str, int]]  # per agent: illegal, random_moves, forfeits
    phases: int
    error: ErrorRecord | None = None
    seating: dict[str, str] = field(default_factory=dict)  # agent -> policy name
    earlier_turns: dict[str, list[Trajectory]] = field(default_factory=dict)  # context="turn": all but the last
    opening: int = 0  # the first ``opening`` of ``moves`` were the opening (``run(openings=...)``), no policy's

    def agent_trajectories(self, agent: str) -> list[Trajectory]:
        """Everything ``agent`` sampled in this game: one conversation, or one per decision (context="turn")."""
        last = [self.trajectories[agent]] if agent in self.trajectories else []
        return self.earlier_turns.get(agent, []) + last


@dataclass
class Played:
    """One :meth:`ProtocolCoordinator.play`: the games and where the time went."""

    results: list[GameResult]
    elapsed_s: float
    generate_s: float
    generate_calls: int

    @property
    def share_outside_generate(self) -> float:
        return (self.elapsed_s - self.generate_s) / max(self.elapsed_s, 1e-9)


@dataclass
class _Seat:
    """One model-played agent in one game: its conversation so far."""

    traj: Trajectory
    last_stop: int | None = None
    next_observation: str | None = None  # set by a retry; else the bridge's prompt


class _Game:
    def __init__(self, seed: int, env: Any, bridge: Bridge, seating: dict[str, str]):
        self.seed, self.env, self.bridge, self.seating = seed, env, bridge, seating
        self.seats: dict[str, _Seat] = {}
        self.earlier_turns: dict[str, list[Trajectory]] = {}
        self.moves: list[tuple[str, int | str]] = []
        self.error: ErrorRecord | None = None
        self.phases = 0
        self.opening = 0  # moves played before the seated policies took over (random or replayed)

    def waiting(self) -> list[str]:
        return [] if self.error is not None else self.bridge.waiting()

    def rng(self) -> random.Random:
        """The randomness of the game's next move (a random or scripted one), seeded by game and move, so
        its games replay exactly."""
        return random.Random(self.seed * 7919 + len(self.moves))


class ProtocolCoordinator:
    """Plays phase-synchronized multi-agent games (PettingZoo AEC or parallel envs, one per seed) for a
    job, as a Ray actor in the job's bundle 0: each phase gathers every live game's pending decisions,
    asks each policy's fleet (built here from worker handles) for them in one batch, and steps the games.
    It owns the game envs, the text bridges and its fleets; ``run`` returns one ``GameResult`` a seed."""

    def __init__(self, make_env: Callable[[], Any], text: GameText, policies: dict[str, Policy], tokenizer: Any = None,
                 *, rules: MoveRules | None = None, limits: Limits | None = None, system_prompt: str | None = None,
                 env_name: str = "game", context: str = "game",
                 move_reward: Callable[[Any, str, Any], float] | None = None):
        if context not in ("game", "turn"):
            raise ValueError(f"context must be 'game' (one conversation per agent and game) or 'turn' (each "
                             f"decision sees only the current observation), got {context!r}")
        self.make_env, self.text, self.policies, self.context = make_env, text, policies, context
        self.move_reward = move_reward
        self.rules = rules or MoveRules()
        self.limits = limits or Limits(max_turns=10_000, max_tokens_per_turn=16, max_tokens_per_episode=10_000,
                                       max_model_len=2048)
        self.tokenizer, self.system_prompt, self.env_name = tokenizer, system_prompt, env_name
        if any(p.kind == "model" for p in policies.values()) and tokenizer is None:
            raise ValueError("model policies need the tokenizer")
        self.continuation = ChatContinuation(tokenizer) if tokenizer is not None else None
        fleets: dict[tuple[Any, ...], RolloutFleet] = {}  # policies on the same workers share one fleet
        self.generators: dict[str, GenerateFn] = {}
        for key, p in policies.items():
            if p.kind == "model":
                self.generators[key] = p.generate or fleets.setdefault(p.workers, RolloutFleet(list(p.workers))).generate
        self.generate_s = 0.0  # time inside generate calls, for the share of phase time outside them
        self.generate_calls = 0

    # ------------------------------------------------------------------ the phase loop

    def ping(self) -> bool:
        return True

    def run(self, seeds: Sequence[int], seating: dict[str, str] | Sequence[dict[str, str]] | None = None,
            openings: Sequence[Opening] | None = None) -> list[GameResult]:
        """Play one game per seed. ``seating``: agent -> policy name, for all games or one per game;
        None when ``policies`` is keyed by agent. ``openings``: per game, what is played before the seated
        policies take over: a number of plies of uniformly random legal moves (seeded by the game's seed, so
        games of one seed share them) or a list of actions, replayed in turn (another game's first moves);
        they are in the game's ``moves`` but in no trajectory."""
        seatings = list(seating) if isinstance(seating, (list, tuple)) else [seating] * len(seeds)
        openings = list(openings) if openings is not None else [0] * len(seeds)
        if not len(seatings) == len(openings) == len(seeds):
            raise ValueError(f"{len(seeds)} seeds but {len(seatings)} seatings and {len(openings)} openings")
        games = []
        for seed, seats, opening in zip(seeds, seatings, openings):
            env = self.make_env()
            seats = dict(seats) if seats is not None else {a: a for a in env.possible_agents}
            missing = sorted(a for a in env.possible_agents if seats.get(a) not in self.policies)
            if missing:
                raise ValueError(f"no policy for agent(s) {missing}; seating {seats}, policies {sorted(self.policies)}")
            games.append(_Game(seed, env, bridge_for(env, self.text, self.rules, seed), seats))
            self._open(games[-1], opening)
        while True:
            by_policy: dict[str, list[tuple[_Game, str]]] = {}
            for g in games:
                if len(g.moves) >= self.limits.max_turns and g.waiting():
                    self._fail(g, "timeout", f"the game reached max_turns={self.limits.max_turns} moves unfinished")
                waiting = g.waiting()
                g.phases += bool(waiting)
                for agent in waiting:  # agents sharing one policy share its call
                    by_policy.setdefault(g.seating[agent], []).append((g, agent))
            if not by_policy:
                break
            for name, decisions in by_policy.items():
                self._decide(name, decisions)
        return [self._result(g) for g in games]

    def play(self, seeds: Sequence[int], seating: dict[str, str] | Sequence[dict[str, str]] | None = None,
             openings: Sequence[Opening] | None = None) -> Played:
        """:meth:`run`, timed: wall time and the part of it spent inside generate calls."""
        gen0, calls0, t0 = self.generate_s, self.generate_calls, time.perf_counter()
        results = self.run(seeds, seating, openings)
        return Played(results, time.perf_counter() - t0, self.generate_s - gen0, self.generate_calls - calls0)

    def _open(self, g: _Game, opening: Opening) -> None:
        """Play the opening: ``opening`` rounds of random legal moves (one move in an AEC game, one per live
        agent in a parallel one), or the listed actions in turn; one that ends the game leaves no decisions."""
        moves = iter(opening) if isinstance(opening, (list, tuple)) else None
        try:
            for _ in range(len(opening) if moves is not None else opening):
                waiting = g.waiting()
                if not waiting:  # the opening ended the game
                    break
                for agent in waiting:
                    legal = g.bridge.legal(agent)
                    if not legal:
                        raise ValueError(f"{agent} has no listed legal moves to open the game with; "
                                         "set game.opening_plies: 0 for this game")
                    action = next(moves) if moves is not None else g.rng().choice(legal)
                    self._apply(g, agent, g.bridge.play(agent, action))
        except StopIteration:  # a parallel game's rounds take several actions: the listed ones ran out
            pass
        except Exception as e:  # noqa: BLE001 - an env's failure or an illegal replayed move: this game only
            self._fail(g, "env_exception", e)
        g.opening = len(g.moves)

    def _decide(self, name: str, decisions: list[tuple[_Game, str]]) -> None:
        policy = self.policies[name]
        if policy.kind != "model":
            for g, agent in decisions:
                try:
                    rng = g.rng()
                    if policy.kind == "random":
                        action = rng.choice(g.bridge.legal(agent))
                    else:
                        extra = {"rng": rng} if policy.takes_rng else {}
                        action = policy.fn(g.bridge.observation(agent), agent, **extra)
                    self._apply(g, agent, g.bridge.play(agent, action))
                except Exception as e:  # noqa: BLE001 - a scripted policy's bug ends that game only
                    self._fail(g, "policy_exception", e)
            return
        ready = self._prepare(decisions)
        if not ready:
            return
        budgets = [self._budget(g.seats[a]) for g, a in ready]
        t0 = time.perf_counter()
        try:
            results = self.generators[name]([g.seats[a].traj.token_ids for g, a in ready],
                                      replace(policy.params, max_tokens=max(1, min(budgets))), 1)
        except Exception as e:  # noqa: BLE001 - a failed call ends these games, not the others
            for g, _ in ready:
                self._fail(g, "rollout_failed", e)
            return
        finally:
            self.generate_s += time.perf_counter() - t0
            self.generate_calls += 1
        for (g, agent), res in zip(ready, results):
            sample, seat = res.samples[0], g.seats[agent]
            seat.traj.append(sample.token_ids, sampled=True, logprobs=sample.logprobs)
            seat.traj.policy_version = res.policy_version
            stopped = sample.finish_reason is FinishReason.STOP
            seat.last_stop = sample.token_ids[-1] if stopped else None
            body = sample.token_ids[:-1] if stopped else sample.token_ids
            reply = self.tokenizer.decode(body, skip_special_tokens=False)
            seat.traj.messages.append({"role": "assistant", "content": reply})
            seat.traj.num_turns += 1
            illegal_before = g.bridge.counts[agent]["illegal"]
            observed = g.bridge.observation(agent) if self.move_reward is not None else None
            decision = g.bridge.act(agent, reply)
            self._apply(g, agent, decision)
            seat.traj.info["illegal_replies"] = (seat.traj.info.get("illegal_replies", 0)
                                                 + g.bridge.counts[agent]["illegal"] - illegal_before)
            if self.move_reward is not None and decision.kind == "played":
                self._reward_move(g, seat, agent, observed, decision.action)

    def _reward_move(self, g: _Game, seat: _Seat, agent: str, observed: Any, action: Any) -> None:
        """``move_reward`` of a model's own legal move, added to its trajectory's ``info``; the function's
        failure (or a value that is not a finite number) ends that game only, as an env's would."""
        try:
            value = float(self.move_reward(observed, agent, action))
            if not math.isfinite(value):
                raise ValueError(f"move_reward returned {value} for {agent}'s move {action!r}: give a finite number")
        except Exception as e:  # noqa: BLE001 - the shaping function's bug ends this game, not the others
            self._fail(g, "env_exception", e)
            return
        seat.traj.info["move_reward"] = seat.traj.info.get("move_reward", 0.0) + value

    def _prepare(self, decisions: list[tuple[_Game, str]]) -> list[tuple[_Game, str]]:
        """Add each deciding agent's current observation to its conversation (the phase's texts tokenized in one
        call); the decisions whose conversations still fit."""
        texts: list[str | list[int]] = []
        for g, agent in decisions:
            observation = g.seats[agent].next_observation if agent in g.seats else None
            observation = observation or g.bridge.prompt(agent)
            if self.context == "turn" and agent in g.seats:  # each decision starts a fresh conversation
                g.earlier_turns.setdefault(agent, []).append(g.seats.pop(agent).traj)
            if agent in g.seats:
                seat = g.seats[agent]
                texts.append(self.continuation.next_text(observation, seat.last_stop))
                seat.traj.messages.append({"role": "user", "content": observation})
                seat.next_observation = None
            else:
                traj = Trajectory(task=Task(id=f"{self.env_name}-{g.seed}", env=self.env_name, data={"seed": g.seed}),
                                  agent_id=agent)
                traj.messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
                traj.messages.append({"role": "user", "content": observation})
                g.seats[agent] = _Seat(traj)
                first = self.continuation.first_text(observation, self.system_prompt)
                texts.append(first if first is not None else self.continuation.first_ids(observation, self.system_prompt))
        encoded = iter(self.continuation.encode_many([t for t in texts if isinstance(t, str)]))
        ready = []
        for (g, agent), text in zip(decisions, texts):
            seat = g.seats[agent]
            ids = next(encoded) if isinstance(text, str) else text
            if not seat.traj.token_ids:
                seat.traj.prompt_len = len(ids)
            seat.traj.append(ids, sampled=False)
            if self._budget(seat) > 0:
                ready.append((g, agent))
            else:
                self._fail(g, "context_full", f"{agent}'s conversation no longer fits max_model_len="
                                              f"{self.limits.max_model_len}")
        return ready

    def _budget(self, seat: _Seat) -> int:
        lim = self.limits
        return min(lim.max_tokens_per_turn, lim.max_tokens_per_episode - seat.traj.num_sampled,
                   lim.max_model_len - len(seat.traj.token_ids))

    def _apply(self, g: _Game, agent: str, decision: Decision) -> None:
        if decision.kind in ("played", "random"):
            g.moves.append((agent, decision.action))
        elif decision.kind == "retry" and agent in g.seats:
            g.seats[agent].next_observation = decision.observation

    def _fail(self, g: _Game, kind: str, err: BaseException | str) -> None:
        msg = err if isinstance(err, str) else f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
        g.error = ErrorRecord(kind, msg[:2000], turn=len(g.moves))

    def _result(self, g: _Game) -> GameResult:
        rewards = {a: 0.0 for a in g.env.possible_agents} if g.error is not None else g.bridge.rewards()
        for agent, traj in [(a, t) for a, ts in g.earlier_turns.items() for t in ts] + \
                [(a, s.traj) for a, s in g.seats.items()]:
            traj.reward = rewards[agent]
            traj.finished = g.error is None
            traj.error = g.error
            traj.info.update({"role": agent, "game_seed": g.seed, "policy": g.seating[agent],
                              **g.bridge.counts[agent]})
        return GameResult(g.seed, rewards, g.moves, {a: s.traj for a, s in g.seats.items()}, g.bridge.counts,
                          g.phases, g.error, g.seating, g.earlier_turns, g.opening)
