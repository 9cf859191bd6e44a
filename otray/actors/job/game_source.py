"""A multi-agent game (config section ``game``) as a :class:`~otray.actors.job.step.GroupSource`.

One batch: ``algo.batch_size`` fresh game seeds, each played ``game.num_rollouts`` times
(and, with ``rotate_seats``, in every rotation of the seating) in one synchronized run of
the ProtocolCoordinator actor. Each trained agent's trajectory carries its PettingZoo
reward (minus ``game.illegal_penalty`` per illegal reply *in that trajectory*: with ``context: turn`` only
the decision that made it pays, not the game's other decisions; with ``context: turn`` and
``game.discount`` < 1 a decision k of its agent's moves before the end gets ``discount**k`` of the
outcome: :func:`training_rewards`; plus the ``game.move_reward`` its moves earned, the shaping the
coordinator computes); with ``game.opening_plies`` a seed's training games share one
opening (:func:`opening`: random plies, or the first moves of a game of the step before), so a group's
first decisions are from one position; trajectories are grouped by (seed, seating, role) for each
trained policy, and the RL step treats those groups exactly like an env's. Evaluation: each trained policy against each of ``game.eval_opponents`` in
every role, win / draw / loss rates.

The coordinator actor holds the games' envs (bundle 0, no CPU of its own) and is given
rollout worker *handles*: each trained policy's, and one worker per ``frozen:`` policy
(created here). It routes over them with fleets of its own; ``random`` and ``scripted:``
policies run inside it.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from pathlib import Path
from typing import Any

from otray import metric_keys as K
from otray.checkpoints import frozen_model_dir
from otray.actors.job.runtime import ActorFactory
from otray.placement import in_bundle
from otray.actors.job.step import Batch
from otray.algos.ratings import EloTable, game_score
from otray.actors.job.league import League
from otray.config import Config, eval_opponents, frozen_policies, policy_bundles, seating, trained_policies
from otray.actors.rollout.agent_loop import Limits
from otray.actors.rollout.protocol import GameResult, Opening, Played, Policy, ProtocolCoordinator
from otray.actors.rollout.text_bridge import MoveRules
from otray.games import GameText
from otray.policies import (PolicySpec, league_fixed, league_on, move_reward_function, scripted_function,
                            training_seatings)
from otray.structured import import_object
from otray.types import ConfigError, SamplingParams, Trajectory, TrajectoryGroup


def game_text(path: str, kwargs: dict[str, Any]) -> GameText:
    """``game.text``: a GameText, or a function of the game's kwargs returning one."""
    obj = import_object(path)
    text = obj if isinstance(obj, GameText) else obj(**kwargs)
    if not isinstance(text, GameText):
        raise ConfigError(f"game.text={path!r} gave {type(text).__name__}, not a GameText")
    return text


def check_turn_budget(text: GameText, tokenizer: Any, max_tokens_per_turn: int) -> None:
    """A ConfigError when a well-formed reply (``text.example``) plus the end of turn does not fit."""
    need = len(tokenizer.encode(text.example, add_special_tokens=False)) + 1
    if max_tokens_per_turn < need:
        raise ConfigError(f"game.max_tokens_per_turn={max_tokens_per_turn} cannot fit a well-formed reply: "
                          f"{text.example!r} plus the end of turn is {need} tokens; set it to at least {need}")


def seatings(seats: dict[str, PolicySpec], roles: list[str], rotate: bool) -> list[dict[str, PolicySpec]]:
    """The configured seating and, with ``rotate``, its other cyclic rotations (self-play: one)."""
    if not rotate:
        return [seats]
    specs = [seats[a] for a in roles]
    rotations = [{a: specs[(i - k) % len(specs)] for i, a in enumerate(roles)} for k in range(len(specs))]
    return list({tuple(r.items()): r for r in rotations}.values())


def opening(seed: int, most: int, played: list[list[Any]] | None = None) -> Opening:
    """What opens the training games of ``seed`` (``game.opening_plies`` = ``most``), drawn from the seed so
    every rollout and seating of the seed opens alike: 0..``most`` random plies, or, given ``played`` (the
    moves of earlier games), the first k of one of them, k below its length (never its deciding move)."""
    if not most:
        return 0
    rng = random.Random(seed * 104_729 + 17)
    if not played:
        return rng.randint(0, most)
    moves = rng.choice(played)
    return list(moves[:rng.randint(0, min(most, len(moves) - 1))])


def training_rewards(outcome: float, turns: list[Trajectory], discount: float, penalty: float) -> list[float]:
    """Each of one agent's trajectories of a game (in move order) and its training reward: the game's
    ``outcome`` times ``discount ** k`` for the decision ``k`` of the agent's moves before its last (the
    last gets the outcome whole: with discount < 1 the move that lost or won the game is told most, the
    opening least), minus ``penalty`` per unreadable or illegal reply of that trajectory itself, plus the
    ``move_reward`` its moves earned (``game.move_reward``; 0 without it)."""
    n = len(turns)
    return [outcome * discount ** (n - 1 - i) - penalty * t.info.get("illegal_replies", 0)
            + t.info.get("move_reward", 0.0) for i, t in enumerate(turns)]


class GameGroupSource:
    def __init__(self, cfg: Config, factory: ActorFactory, tokenizer: Any, max_model_len: int,
                 trained_workers: dict[str, tuple[Any, ...]], job_dir: str | Path):
        import ray

        from otray.actors.sampling.rollout import wait_ready

        g = self.game = cfg.game
        self.cfg = cfg
        make_env = functools.partial(import_object(g.entry), **g.kwargs)
        self.roles = list(make_env().possible_agents)
        if set(g.policies) != set(self.roles):
            raise ConfigError(f"game.policies must name exactly the game's agents {self.roles}; got {sorted(g.policies)}")
        self.seatings = training_seatings(cfg) or seatings(seating(cfg), self.roles, g.rotate_seats)
        self.trained = list(trained_workers)
        self.opponents = eval_opponents(cfg)
        first = len(trained_policies(cfg)) * policy_bundles(cfg)  # bundles after the trained policies'
        frozen = {spec: tuple(factory.workers(first + j, 1, frozen_model_dir(spec.arg, job_dir), prefix=f"frozen-{j}/"))
                  for j, spec in enumerate(frozen_policies(cfg))}
        first += len(frozen)  # then one league worker per trained policy (it starts as the job's model)
        self.league = League(g.league, self.trained, {n: tuple(factory.workers(first + i, 1, prefix=f"league-{n}/"))
                                                      for i, n in enumerate(self.trained)}, cfg.job.seed) \
            if league_on(cfg) else None
        wait_ready([w for ws in [*frozen.values(), *(self.league.workers.values() if self.league else ())] for w in ws])
        text = game_text(g.text, g.kwargs)
        check_turn_budget(text, tokenizer, g.max_tokens_per_turn)
        sampled = SamplingParams(max_tokens=g.max_tokens_per_turn, temperature=g.temperature)
        greedy = SamplingParams(max_tokens=g.max_tokens_per_turn, temperature=0.0)
        library: dict[str, Policy] = {"random": Policy("random")}
        for spec, workers in [*((PolicySpec("trained", n), w) for n, w in trained_workers.items()), *frozen.items()]:
            library[str(spec)] = Policy("model", name=str(spec), workers=workers, params=sampled)
            library[f"{spec}/greedy"] = Policy("model", name=f"{spec}/greedy", workers=workers, params=greedy)
        if self.league is not None:
            library.update(self.league.library(sampled))
        seated = [p for seats in [seating(cfg), *self.seatings] for p in seats.values()]
        for spec in [*seated, *self.opponents, *league_fixed(cfg)]:
            if spec.kind == "scripted":
                library[str(spec)] = Policy("scripted", name=str(spec), fn=scripted_function(spec))
        self.coordinator = factory.start(ray.remote(num_cpus=0)(ProtocolCoordinator),
            in_bundle(factory.placement_group, 0), "coordinator",
            make_env, text, library, tokenizer, rules=MoveRules(g.max_retries, g.on_exhausted),
            limits=Limits(max_turns=g.max_turns or 10_000, max_tokens_per_turn=g.max_tokens_per_turn,
                          max_tokens_per_episode=g.max_tokens_per_episode, max_model_len=max_model_len),
            env_name=g.entry, context=g.context,
            move_reward=move_reward_function(cfg))
        ray.get(self.coordinator.ping.remote())
        self.next_seed = cfg.job.seed * 1_000_003  # the data position: seeds are used once
        self.elo = EloTable(k=g.elo_k, anchor="random")  # every player evaluated so far, by label
        self.generate_s = 0.0
        self.first_rollout_at: float | None = None
        self.openings: list[list[Any]] = []  # game.openings=played: the last step's games' moves

    def play(self, seeds: list[int], seats: list[dict[str, str]], openings: list[Opening] | None = None) -> Played:
        import ray

        if self.first_rollout_at is None:
            self.first_rollout_at = time.time()
        played = ray.get(self.coordinator.play.remote(seeds, seats, openings))
        self.generate_s += played.generate_s
        return played

    def next_batch(self, seed_step: int) -> Batch:
        g, t0 = self.game, time.perf_counter()
        seeds = [self.next_seed + i for i in range(self.cfg.algo.batch_size)]
        self.next_seed += len(seeds)
        plain = [{a: str(p) for a, p in seats.items()} for seats in self.seatings]
        n_league = round(g.league.share * len(seeds)) if self.league is not None else 0
        if self.league is not None:
            self.league.draw(seed_step)
        seat_lists = {s: (self.league.seatings(seating(self.cfg), s, seed_step) if i < n_league else plain)
                      for i, s in enumerate(seeds)}  # the first seeds of the step meet the league
        games = [(s, k, seats) for s in seeds for k, seats in enumerate(seat_lists[s]) for _ in range(g.num_rollouts)]
        played = self.play([s for s, _, _ in games], [seats for *_, seats in games],
                           [opening(s, g.opening_plies, self.openings) for s, _, _ in games])
        if g.openings == "played":  # the next step's openings: this step's finished games
            self.openings = [[a for _, a in r.moves] for r in played.results if r.error is None and r.moves]
        rollout_s = time.perf_counter() - t0
        groups: dict[str, list[TrajectoryGroup]] = {}
        metrics: dict[str, Any] = {}
        shown: list[Trajectory] = []
        for name in self.trained:
            me, by_key = f"trained:{name}", {}
            for (seed, k, _), r in zip(games, played.results):
                for agent in (a for a, spec in r.seating.items() if spec == me):
                    turns = r.agent_trajectories(agent)  # one per game, or one per decision (context: turn)
                    rewards = training_rewards(r.rewards[agent], turns, g.discount, g.illegal_penalty)
                    for t, reward in zip(turns, rewards):
                        t.reward = reward
                        by_key.setdefault((seed, k, agent), []).append(t)
            groups[name] = [TrajectoryGroup(ts[0].task, ts, key=key, max_failing=g.max_failing_rollouts)
                            for key, ts in by_key.items()]
            if by_key:  # log the seats of one seed and seating
                first = next(iter(by_key))[:2]
                shown.extend([t for key, ts in by_key.items() if key[:2] == first for t in ts][:8])
            seats = [((r.seed, k, a), r) for (_, k, _), r in zip(games, played.results) if r.error is None
                     for a, spec in r.seating.items() if spec == me]
            prefix = "" if len(self.trained) == 1 else f"policy/{name}/"
            metrics.update({prefix + k: v for k, v in self.outcomes(seats).items()})
        results = played.results
        if self.league is not None:
            league_seeds = set(seeds[:n_league])
            metrics.update(self.league.record([r for r in results if r.seed in league_seeds], self.elo))
        metrics.update({"games": len(results), "games_errored": sum(r.error is not None for r in results),
                        "phase_share_outside_generate": played.share_outside_generate})
        sampled = sum(t.num_sampled for r in results for a in r.seating for t in r.agent_trajectories(a))
        return Batch(groups, f"seeds {seeds[0]}-{seeds[-1]}", rollout_s, 0.0, played.generate_s, sampled,
                     metrics, shown)

    def outcomes(self, seats: list[tuple[tuple[int, int, str], GameResult]]) -> dict[str, float]:
        """Reward, win rate and illegal moves per game of one policy's seats, overall and per role."""
        out: dict[str, float] = {}
        for role in [None, *self.roles]:
            mine = [(agent, r) for (_, _, agent), r in seats if role is None or agent == role]
            if mine:
                prefix = "" if role is None else f"{role}/"
                out[prefix + K.REWARD_MEAN] = statistics.fmean(r.rewards[a] for a, r in mine)
                out[prefix + "win_rate"] = statistics.fmean(r.rewards[a] > 0 for a, r in mine)
                out[prefix + "illegal_per_game"] = statistics.fmean(r.counts[a]["illegal"] for a, r in mine)
                if self.game.move_reward:  # the shaping a game of this seat earned
                    out[prefix + "move_reward_per_game"] = statistics.fmean(
                        sum(t.info.get("move_reward", 0.0) for t in r.agent_trajectories(a)) for a, r in mine)
        return out

    def eval_games(self, greedy: bool, count: int | None = None
                   ) -> list[tuple[str, PolicySpec, str, list[GameResult]]]:
        """Each trained policy in every role against each eval opponent (other seats hold the opponent),
        ``count`` (default ``game.eval_games``) fixed seeds each, in one coordinator run:
        (policy, opponent, role, games)."""
        seeds = list(range(10**9, 10**9 + (count or self.game.eval_games)))  # fixed, never used in training
        runs = []
        for name in self.trained:
            me = f"trained:{name}" + ("/greedy" if greedy else "")
            for opponent in self.opponents:
                opp = str(opponent) + ("/greedy" if greedy and opponent.kind == "frozen" else "")
                for role in self.roles:
                    runs.append((name, opponent, role, {a: me if a == role else opp for a in self.roles}))
        played = self.play([s for _ in runs for s in seeds], [seats for *_, seats in runs for _ in seeds])
        return [(name, opponent, role, played.results[i * len(seeds):(i + 1) * len(seeds)])
                for i, (name, opponent, role, _) in enumerate(runs)]

    def evaluate(self, step: int, greedy: bool) -> dict[str, float]:
        """OpenTinker's four rates (:func:`game_rates`) per policy, role and opponent of :meth:`eval_games`;
        every game with a result updates the job's Elo table (``elo/<player>``); ``eval/accuracy`` is the
        mean win rate."""
        out, wins = {}, []
        for name, opponent, role, results in self.eval_games(greedy):
            if not results:
                continue
            prefix = "eval/" + ("" if len(self.trained) == 1 else f"{name}/") + f"{role}_vs_{opponent.label}/"
            out.update({prefix + k: v for k, v in game_rates(results, role).items()})
            wins.append(out[prefix + "win_rate"])
            self.elo.record_all(name, opponent.label,
                                [game_score(r.rewards[role]) for r in results if r.error is None])
        if wins:
            out[K.EVAL_ACCURACY] = statistics.fmean(wins)
        return {**out, **self.elo.metrics()}

    def state(self) -> dict[str, Any]:
        return {"game_seed": self.next_seed}

    def lasting_state(self) -> dict[str, Any]:
        return {"elo": self.elo.state(), **({"league": self.league.state()} if self.league is not None else {})}

    def load_state(self, state: dict[str, Any]) -> None:
        if "game_seed" in state:
            self.next_seed = state["game_seed"]
        if "elo" in state:
            self.elo = EloTable.from_state(state["elo"])
        if "league" in state and self.league is not None:
            self.league.load_state(state["league"])


TIMEOUT_KINDS = ("timeout", "context_full")  # a game that ran out of moves, tokens or context before it ended


def game_rates(results: list[GameResult], role: str) -> dict[str, float]:
    """OpenTinker's four outcome rates of ``role`` over ``results`` (win, loss, draw, timeout: a game that hit
    ``game.max_turns`` or a token/context budget), the share that failed otherwise (``error_rate``: a policy's
    exception, a failed generate call) and illegal moves per game; the five rates sum to 1."""
    n = len(results)
    done = [r.rewards[role] for r in results if r.error is None]
    timeouts = sum(r.error is not None and r.error.kind in TIMEOUT_KINDS for r in results)
    return {"win_rate": sum(x > 0 for x in done) / n, "loss_rate": sum(x < 0 for x in done) / n,
            "draw_rate": sum(x == 0 for x in done) / n, "timeout_rate": timeouts / n,
            "error_rate": (n - len(done) - timeouts) / n,
            "illegal_per_game": statistics.fmean(r.counts[role]["illegal"] for r in results)}
