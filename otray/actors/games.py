"""Training on a multi-agent game (config section ``game``): the RL step of ARCHITECTURE.md
with a ProtocolCoordinator actor in place of the single-agent loop.

One step: ``algo.batch_size`` fresh game seeds, each played ``game.num_rollouts`` times
(and, with ``rotate_seats``, in every rotation of the seating) in one synchronized
coordinator run -> each trained agent's trajectory gets its PettingZoo reward ->
advantages grouped by (seed, seating, role) -> every trained policy's learner updates on
its own agents' trajectories -> weights pushed -> next step. Evaluation: each trained
policy against each of ``game.eval_opponents`` in every role, win / draw / loss rates.

Policies (see ``GameSection``): each ``trained:NAME`` has a learner and a rollout fleet
(the first is the job's own), each ``frozen:REF`` one rollout worker; ``random`` and
``scripted:`` policies run inside the coordinator.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otray.actors.checkpoint_store import frozen_model_dir
from otray.algos import advantages as adv
from otray.algos.datums import build_datums
from otray.config import frozen_policies, import_object, num_rollout_workers, policy_name, trained_policies
from otray.timing import StepClock
from otray.coordinator.agent_loop import Limits
from otray.coordinator.protocol import GameResult, Played, Policy, ProtocolCoordinator
from otray.coordinator.text_bridge import GameText, MoveRules
from otray.types import ConfigError, SamplingParams


@dataclass
class TrainedPolicy:
    """One policy the job trains: its learner and the rollout fleet that samples from it."""

    name: str
    learner: Any
    fleet: Any


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


def short(spec: str) -> str:
    """A policy spec as a metric-name part: ``scripted:envs.x:heuristic`` -> ``heuristic``,
    ``frozen:JOB_ID:7`` -> ``frozen-JOB_ID-7``, ``frozen:/runs/a/checkpoints/step-000010`` -> ``frozen-step-000010``."""
    kind, _, ref = spec.partition(":")
    if kind == "frozen":
        return "frozen-" + (Path(ref.rstrip("/")).name if "/" in ref else ref.replace(":", "-"))
    return spec.split(":")[-1]


class GameTrainer:
    def __init__(self, job: Any):
        import ray

        from otray.actors.job_actors import in_bundle
        from otray.actors.rollout import RolloutFleet, wait_ready

        self.job, self.game, cfg = job, job.cfg.game, job.cfg
        self.make_env = functools.partial(import_object(self.game.entry), **self.game.kwargs)
        self.roles = list(self.make_env().possible_agents)
        if set(self.game.policies) != set(self.roles):
            raise ConfigError(f"game.policies must name exactly the game's agents {self.roles}; "
                              f"got {sorted(self.game.policies)}")
        self.seating = {a: policy_name(p) for a, p in self.game.policies.items()}
        names, per = trained_policies(cfg), 1 + num_rollout_workers(cfg)
        self.trained = {names[0]: TrainedPolicy(names[0], job.learner, job.fleet)}
        for k, name in enumerate(names[1:], start=1):  # block k of the placement group: learner + workers
            self.trained[name] = TrainedPolicy(name, job.make_learner(k * per),
                                               RolloutFleet(job.make_workers(k * per + 1, per - 1, job.model_path)))
        frozen = {spec: RolloutFleet(job.make_workers(len(names) * per + j, 1,
                                                      frozen_model_dir(spec.split(":", 1)[1], job.dir)))
                  for j, spec in enumerate(frozen_policies(cfg))}
        wait_ready([h for t in list(self.trained.values())[1:] for h in (t.learner, *t.fleet.workers)]
                   + [w for f in frozen.values() for w in f.workers])
        for t in list(self.trained.values())[1:]:  # every trained policy starts from the same weights
            job.sync_weights(t.learner, t.fleet)
        g = self.game
        text = game_text(g.text, g.kwargs)
        check_turn_budget(text, job.tokenizer, g.max_tokens_per_turn)
        sampled = SamplingParams(max_tokens=g.max_tokens_per_turn, temperature=g.temperature)
        greedy = SamplingParams(max_tokens=g.max_tokens_per_turn, temperature=0.0)
        library: dict[str, Policy] = {"random": Policy("random")}
        for spec, fleet in [*((f"trained:{n}", t.fleet) for n, t in self.trained.items()), *frozen.items()]:
            library[spec] = Policy("model", name=spec, generate=fleet.generate, params=sampled)
            library[spec + "/greedy"] = Policy("model", name=spec + "/greedy", generate=fleet.generate, params=greedy)
        for spec in [*self.game.policies.values(), *self.game.eval_opponents]:
            if spec.startswith("scripted:"):
                library[spec] = Policy("scripted", name=spec, fn=import_object(spec.split(":", 1)[1]))
        # the coordinator actor: the games' envs live in its process (bundle 0, no CPU of its own)
        self.coordinator = ray.remote(num_cpus=0)(ProtocolCoordinator).options(**in_bundle(job.placement_group, 0)).remote(
            self.make_env, text, library, job.tokenizer,
            rules=MoveRules(g.max_retries, g.on_exhausted),
            limits=Limits(max_turns=10_000, max_tokens_per_turn=g.max_tokens_per_turn,
                          max_tokens_per_episode=g.max_tokens_per_episode,
                          max_model_len=job.worker_info["max_model_len"]),
            env_name=g.entry, context=g.context)
        ray.get(self.coordinator.ping.remote())
        self.next_seed = job.cfg.job.seed * 1_000_003  # the data position: seeds are used once

    def seatings(self) -> list[dict[str, str]]:
        """The configured seating and, with ``rotate_seats``, its other cyclic rotations."""
        if not self.game.rotate_seats:
            return [self.seating]
        specs = [self.seating[a] for a in self.roles]
        rotations = [{a: specs[(i - k) % len(specs)] for i, a in enumerate(self.roles)} for k in range(len(specs))]
        return list({tuple(r.items()): r for r in rotations}.values())  # self-play: one seating, not n copies

    def play(self, seeds: list[int], seatings: list[dict[str, str]]) -> Played:
        import ray

        played = ray.get(self.coordinator.play.remote(seeds, seatings))
        self.job.generate_s += played.generate_s
        return played

    def step(self) -> dict[str, Any]:
        job, algo, t0, clock = self.job, self.job.cfg.algo, time.perf_counter(), StepClock()
        seeds = [self.next_seed + i for i in range(algo.batch_size)]                    # 1. game seeds
        self.next_seed += algo.batch_size
        games = [(s, k, seating) for s in seeds for k, seating in enumerate(self.seatings())
                 for _ in range(self.game.num_rollouts)]
        played = self.play([s for s, _, _ in games], [seating for _, _, seating in games])  # 2-3. games, rewards
        t_gen = time.perf_counter() - t0
        clock.mark("env")
        clock.add("generate", played.generate_s, out_of="env")
        metrics: dict[str, Any] = {}
        to_log: list[tuple[list, dict]] = []
        for name, policy in self.trained.items():                                     # per trained policy:
            mine = [((r.seed, k, agent), r) for (_, k, _), r in zip(games, played.results) if r.error is None
                    for agent, spec in r.seating.items() if spec == f"trained:{name}"]
            keys, trajs = [], []
            for key, r in mine:  # one trajectory per agent and game, or one per decision (context: turn)
                for t in r.agent_trajectories(key[2]):
                    keys.append(key)
                    trajs.append(t)
            rewards = [t.reward - self.game.illegal_penalty * t.info["illegal"] for t in trajs]
            advantages = adv.grouped(algo.advantage, rewards, keys)                        # 4-5. (seed, seating, role)
            datums = build_datums(trajs, advantages)
            clock.mark("prepare")
            learned = job.learn(datums, policy.learner, policy.fleet, clock=clock)        # 6-7. learn, push
            first = {key[:2] for key, _ in mine[:1]}  # log the seats of one seed and seating
            to_log.append(([t for k, t in zip(keys, trajs) if k[:2] in first][:8],
                           {id(t): a for t, a in zip(trajs, advantages)}))
            prefix = "" if len(self.trained) == 1 else f"policy/{name}/"
            metrics.update({prefix + k: v for k, v in {**self.outcomes(mine), **learned}.items()})
        job.step += 1
        for trajs, advantage_of in to_log:
            job.log_episodes(trajs, advantage_of)
        results = played.results
        return {"step": job.step, "batch": f"seeds {seeds[0]}-{seeds[-1]}", **metrics,
                "games": len(results), "games_errored": sum(r.error is not None for r in results),
                "phase_share_outside_generate": played.share_outside_generate,
                "tokens_per_s": sum(t.num_sampled for r in results for a in r.seating
                                    for t in r.agent_trajectories(a)) / max(t_gen, 1e-9),
                "rollout_s": t_gen, "generate_s": played.generate_s, **job.step_times(clock)}

    def outcomes(self, seats: list[tuple[tuple[int, int, str], GameResult]]) -> dict[str, float]:
        """Reward, win rate and illegal moves per game of one policy's seats, overall and per role."""
        out: dict[str, float] = {}
        for role in [None, *self.roles]:
            mine = [(agent, r) for (_, _, agent), r in seats if role is None or agent == role]
            if mine:
                prefix = "" if role is None else f"{role}/"
                out[prefix + "reward_mean"] = statistics.fmean(r.rewards[a] for a, r in mine)
                out[prefix + "win_rate"] = statistics.fmean(r.rewards[a] > 0 for a, r in mine)
                out[prefix + "illegal_per_game"] = statistics.fmean(r.counts[a]["illegal"] for a, r in mine)
        return out

    def eval_games(self, greedy: bool, count: int | None = None) -> list[tuple[str, str, str, list[GameResult]]]:
        """Each trained policy in every role against each eval opponent (other seats hold the opponent),
        ``count`` (default ``game.eval_games``) fixed seeds each, in one coordinator run:
        (policy, opponent, role, games)."""
        seeds = list(range(10**9, 10**9 + (count or self.game.eval_games)))  # fixed, never used in training
        runs = []
        for name in self.trained:
            me = f"trained:{name}" + ("/greedy" if greedy else "")
            for opponent in self.game.eval_opponents:
                opp = opponent + ("/greedy" if greedy and opponent.startswith("frozen:") else "")
                for role in self.roles:
                    runs.append((name, opponent, role, {a: me if a == role else opp for a in self.roles}))
        played = self.play([s for _ in runs for s in seeds], [seating for *_, seating in runs for _ in seeds])
        return [(name, opponent, role, played.results[i * len(seeds):(i + 1) * len(seeds)])
                for i, (name, opponent, role, _) in enumerate(runs)]

    def evaluate(self, greedy: bool) -> dict[str, float]:
        """Win/draw/loss rates of :meth:`eval_games`; ``eval/accuracy`` is the mean win rate (the summary's figure)."""
        out, wins = {}, []
        for name, opponent, role, results in self.eval_games(greedy):
            done = [r for r in results if r.error is None]
            if not done:
                continue
            prefix = "eval/" + ("" if len(self.trained) == 1 else f"{name}/") + f"{role}_vs_{short(opponent)}/"
            out[prefix + "win_rate"] = statistics.fmean(r.rewards[role] > 0 for r in done)
            out[prefix + "draw_rate"] = statistics.fmean(r.rewards[role] == 0 for r in done)
            out[prefix + "loss_rate"] = statistics.fmean(r.rewards[role] < 0 for r in done)
            out[prefix + "illegal_per_game"] = statistics.fmean(r.counts[role]["illegal"] for r in done)
            wins.append(out[prefix + "win_rate"])
        if wins:
            out["eval/accuracy"] = statistics.fmean(wins)
        return out

    # ------------------------------------------------------------------ checkpoints of the other policies

    def save(self, path: Path) -> None:
        import ray

        for name, t in list(self.trained.items())[1:]:
            ray.get(t.learner.save_state.remote(str(path / "policies" / name / "state"), {}))
            ray.get(t.learner.export.remote(str(path / "policies" / name / "model")))

    def load(self, path: Path) -> None:
        import ray

        for name, t in list(self.trained.items())[1:]:
            ray.get(t.learner.load_state.remote(str(path / "policies" / name / "state")))
            self.job.sync_weights(t.learner, t.fleet)


__all__ = ["GameResult", "GameTrainer", "TrainedPolicy", "game_text"]
