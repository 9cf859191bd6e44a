"""TrainJob: the driver of one training job (RL with an optional SFT warm-up, or SFT).

It owns a PolicyLearner actor and a fleet of RolloutWorker actors, and runs the RL
step of ARCHITECTURE.md, readable top to bottom in :meth:`TrainJob.rl_step`; an SFT
job (``job.kind: sft``) runs :meth:`TrainJob.sft_step` on chat data instead, with
rollout workers only when there are envs to evaluate (SFT lives in ``otray/actors/sft.py``,
game jobs' step in ``otray/actors/games.py``, creating the actors and rolling out episodes
in ``otray/actors/job_actors.py``).
Metrics go to ``<job_dir>/metrics.jsonl``, a sample of each step's episodes to
``<job_dir>/trajectories.jsonl``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otray.actors.sft import SFTMixin, batch_digest
from otray.algos import advantages as adv
from otray.algos.datums import build_datums
from otray.actors.job_actors import JobActors, episode_metrics, load_splits, solved
from otray.config import Config, num_rollout_workers, to_dict
from otray.env import Mixture
from otray.models import load_tokenizer, resolve_model_path
from otray.timing import StepClock
from otray.types import Task, Trajectory, TrajectoryGroup


@dataclass
class Batch:
    """One step's rollouts: the tasks, their groups, and what producing them took."""

    tasks: list[Task]
    groups: list[TrajectoryGroup]
    rollout_s: float
    generate_s: float
    sampled: int  # tokens sampled


class TrainJob(SFTMixin, JobActors):
    """Bundle layout in a job's placement group: 0 = learner (and the job driver), 1+i = rollout worker i;
    a game with more trained policies repeats that block per policy, then one bundle per frozen policy
    (``otray.actors.resource_manager.bundles_for``)."""

    def __init__(self, cfg: Config, job_dir: str | Path, *, log: Callable[[str], None] = print,
                 placement_group: Any = None):
        import ray

        from otray.actors.rollout import RolloutFleet, wait_ready

        self.cfg, self.log = cfg, log
        self.dir = Path(job_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        self.splits = {name: load_splits(name, e.dataset, e.splits, cfg.job.seed, f"envs.{name}")
                       for name, e in cfg.envs.items()}
        self.mixture = (Mixture({n: s["train"] for n, s in self.splits.items()},
                                {n: e.weight for n, e in cfg.envs.items()}, seed=cfg.job.seed)
                        if cfg.job.kind == "rl" and cfg.envs else None)
        # chat data: the whole of an SFT job, or an RL job's warm-up data when sft.splits.train is given
        self.chat = (load_splits("sft", cfg.sft.dataset, cfg.sft.splits, cfg.job.seed, "sft")
                     if "train" in cfg.sft.splits else {})
        self.placement_group = placement_group
        self.learner = self.make_learner(0)
        workers = self.make_workers(1, num_rollout_workers(cfg), self.model_path)
        wait_ready([self.learner, *workers])
        self.colocated = cfg.rollout.colocate and (cfg.job.kind == "rl" or bool(cfg.envs))
        infos = ([ray.get(self.learner.start_sampler.remote(cfg.rollout.max_model_len, cfg.rollout.max_batch))]
                 if self.colocated else ray.get([w.info.remote() for w in workers]))
        self.fleet = RolloutFleet([self.learner] if self.colocated else workers) if infos else None
        self.worker_info = infos[0] if infos else {"backend": None, "max_model_len": cfg.rollout.max_model_len}
        self.nodes = {"learner": ray.get(self.learner.info.remote())["node_id"],
                      "rollout": [i["node_id"] for i in infos]}  # Ray node ids, for the record
        self.step = 0
        self.weights_synced = True  # False after optimizer steps that the workers have not seen
        self.first_rollout_at: float | None = None  # wall clock (time.time) of the first rollout
        self.generate_s = 0.0  # time in generate calls, summed; rl_step reports its share
        self.last_rollout_generate_s = 0.0
        self.busy_prev: list[float] = []  # the actors' busy clocks at the end of the last step
        self.learner_version = ray.get(self.learner.info.remote())["policy_version"]
        self.prefetched: Any = None  # off-policy: the next batch, being generated (a Future)
        self.data_before_prefetch: Any = None  # the mixture's state before the prefetched tasks
        self.background = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.pending_episodes: list[dict[str, Any]] = []  # logged, not yet handed to the ResourceManager
        from otray.actors.games import GameTrainer

        self.games = GameTrainer(self) if cfg.game is not None else None  # multi-agent game jobs
        self.startup_s = time.perf_counter() - t0
        log(f"job ready in {self.startup_s:.1f}s: model {self.model_path}, backend {self.worker_info['backend']}, "
            f"{len(workers)} rollout worker(s)" + (" (generating in the learner: rollout.colocate)" if self.colocated else ""))

    def sync_weights(self, learner: Any = None, fleet: Any = None) -> float:
        """Push a learner's weights (default: the job's) to its rollout workers through the object store."""
        t0 = time.perf_counter()
        learner, fleet = learner or self.learner, fleet or self.fleet
        if fleet is not None:  # colocated, the learner samples from the weights it trains: nothing to send
            fleet.update_weights(None if self.colocated else learner.weights.remote())
        if learner is self.learner:
            self.weights_synced = True
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one RL step

    def rl_step(self) -> dict[str, Any]:
        cfg, algo, clock = self.cfg, self.cfg.algo, StepClock()
        batch = self.prefetched.result() if self.prefetched else None                  # 1-3. tasks, episodes,
        if batch is not None:                                                          #      rewards: sampled while
            self.prefetched = None                                                     #      the last step trained
            clock.mark("rollout_wait")
        else:
            batch = self.sample_batch(clock)                                           #      or sampled now
        kept, uniform = [], []                                                         # 4. drop groups: too many
        for g in batch.groups:                                                         #    failed rollouts, or all
            if g.num_failed <= cfg.envs[g.task.env].max_failing_rollouts:              #    rewards equal (no gradient:
                dropped = algo.drop_uniform_groups and len(set(g.rewards)) == 1        #    skip the work)
                (uniform if dropped else kept).append(g)
        trajs, advantages = [], []
        for g in kept:                                                                 # 5. advantages
            trajs.extend(g.trajectories)
            advantages.extend(adv.compute(algo.advantage, g.rewards))
        datums = build_datums(trajs, advantages)
        normalizer = self.loss_normalizer(datums, uniform)
        clock.mark("prepare")
        if algo.max_steps_off_policy:                                                  # (off-policy: the next batch
            self.prefetch()                                                            #  generates meanwhile)
        learned = self.learn(datums, clock=clock, sync=not algo.max_steps_off_policy,  # 6. learn
                             normalizer=normalizer)
        if algo.max_steps_off_policy:                                                  # 7. push weights (off-policy:
            self.prefetched.result()                                                   #    once the next batch is
            clock.mark("rollout_wait")                                                 #    done, so one batch is
            learned["sync_s"] = self.sync_weights()                                    #    one policy version)
            clock.mark("weight_sync")
        self.step += 1
        all_trajs = [t for g in batch.groups for t in g.trajectories]                 # 8. metrics
        self._log_trajectories(batch.groups[:2], {id(t): a for t, a in zip(trajs, advantages)})
        row = {"step": self.step, "batch": batch_digest(batch.tasks), **episode_metrics(all_trajs, ""),
               **self.env_metrics(batch.groups), **self.group_counts(batch.groups, kept),
               "tokens_per_s": batch.sampled / max(batch.rollout_s, 1e-9), "rollout_s": batch.rollout_s,
               "generate_s": batch.generate_s, "policy_lag": self.policy_lag(trajs), **learned}
        return {**row, **self.step_times(clock, batch)}

    @staticmethod
    def loss_normalizer(datums: list, dropped: list[TrajectoryGroup]) -> dict[str, float]:
        """What the loss divides by: the tokens and sequences of the whole batch, the groups dropped
        for having equal rewards included. Their advantages are all zero, so training on them adds
        nothing to the loss's sum; counting them here makes dropping them save compute without
        changing the gradient (as if every group had been trained on)."""
        skipped = build_datums([t for g in dropped for t in g.trajectories],
                               [0.0 for g in dropped for _ in g.trajectories])
        both = [*datums, *skipped]
        return {"tokens": float(sum(sum(d.mask) for d in both)), "sequences": float(len(both))}

    def policy_lag(self, trajs: list[Trajectory]) -> int:
        """Updates between the weights that sampled the oldest trained episode and the weights its
        gradient was taken at: 0 on-policy, 1 one-step-off-policy."""
        if not trajs:
            return 0
        return self.learner_version - 1 - min(t.policy_version for t in trajs)

    def prefetch(self) -> None:
        """Start rolling out the next step's batch in the background with the workers' current weights.
        A checkpoint taken meanwhile saves the data position before these tasks, so a resumed job
        samples them again."""
        self.data_before_prefetch = self.mixture.state()
        tasks = self.mixture.sample(self.cfg.algo.batch_size)
        self.prefetched = self.background.submit(self.sample_batch, None, self.step + 1, tasks)

    def sample_batch(self, clock: StepClock | None = None, seed_step: int | None = None,
                     tasks: list[Task] | None = None) -> Batch:
        """Sample the step's tasks (unless given) and roll them out."""
        t0 = time.perf_counter()
        tasks = tasks if tasks is not None else self.mixture.sample(self.cfg.algo.batch_size)
        if clock is not None:
            clock.mark("sample")
        groups = self.rollout(tasks, seed_step=seed_step)
        rollout_s = time.perf_counter() - t0
        if clock is not None:
            clock.mark("env")
            clock.add("generate", self.last_rollout_generate_s, out_of="env")
        sampled = sum(t.num_sampled for g in groups for t in g.trajectories)
        return Batch(tasks, groups, rollout_s, self.last_rollout_generate_s, sampled)

    def env_metrics(self, groups: list[TrajectoryGroup]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.cfg.envs if len(self.cfg.envs) > 1 else ():
            mine = [t for g in groups if g.task.env == name for t in g.trajectories]
            if mine:
                out.update(episode_metrics(mine, f"env/{name}/"))
        return out

    def group_counts(self, groups: list[TrajectoryGroup], kept: list[TrajectoryGroup]) -> dict[str, int]:
        envs = self.cfg.envs
        return {"groups_kept": len(kept), "groups_dropped_uniform": sum(len(set(g.rewards)) == 1 for g in groups),
                "groups_dropped_failing": sum(g.num_failed > envs[g.task.env].max_failing_rollouts for g in groups)}

    def step_times(self, clock: StepClock, batch: Batch | None = None) -> dict[str, float]:
        """The step's time parts (``otray.timing``), the generation share and the idle fractions of the
        job's learner and rollout workers (a game's first trained policy) from their busy clocks."""
        import ray

        busy = ray.get([self.learner.busy_s.remote(), *[self.fleet.workers[i].busy_s.remote()
                                                         for i in self.fleet.live]])
        prev = self.busy_prev or [0.0] * len(busy)
        delta = [b - p for b, p in zip(busy, prev)] if len(prev) == len(busy) else busy
        self.busy_prev = busy
        clock.mark("other")
        # off-policy: generation ran beside the learner; its share is the batch's generate time
        generate = batch.generate_s if batch is not None and self.cfg.algo.max_steps_off_policy else None
        return clock.metrics(learner_busy_s=delta[0], rollout_busy_s=delta[1:], generate_s=generate)

    def learn(self, datums: list, learner: Any = None, fleet: Any = None, *, clock: StepClock | None = None,
              sync: bool = True, normalizer: dict[str, float] | None = None) -> dict[str, Any]:
        """forward_backward + optim_step with the RL loss on ``datums``, then (``sync``) push the weights
        (of the job's learner, or of ``learner`` to ``fleet`` for a game's other trained policies).
        Returns ``learn_s``, ``sync_s`` and the learner's metrics (``learner/...``); marks ``clock``."""
        import ray

        learner, clock = learner or self.learner, clock or StepClock()
        algo, fb, opt, sync_s, t0 = self.cfg.algo, {}, {}, 0.0, time.perf_counter()
        if datums:
            fb = ray.get(learner.forward_backward.remote(
                datums, algo.loss_fn, algo.loss_fn_config, algo.aggregation, normalizer))
            clock.mark("forward_backward")
            opt = ray.get(learner.optim_step.remote(
                algo.learning_rate, tuple(algo.betas), 1e-8, algo.weight_decay, algo.grad_clip))
            clock.mark("optim_step")
            if learner is self.learner:
                self.learner_version += 1
        learn_s = time.perf_counter() - t0
        if datums and sync:
            sync_s = self.sync_weights(learner, fleet)
            clock.mark("weight_sync")
        return {"learn_s": learn_s, "sync_s": sync_s, **{f"learner/{k}": v for k, v in {**fb, **opt}.items()}}

    # ------------------------------------------------------------------ evaluation

    def accuracy(self, tasks: list[Task], greedy: bool = True) -> float:
        """Share of ``tasks`` solved (info["correct"], else reward > 0) in one episode each."""
        trajs = [t for g in self.rollout(tasks, n=1, greedy=greedy) for t in g.trajectories]
        return statistics.fmean(map(solved, trajs))

    def evaluate(self) -> dict[str, float]:
        """Greedy (or sampled) episodes on each env's eval split; accuracy = share rewarded as correct.

        SFT jobs add ``eval/sft_loss``, the held-out cross-entropy of the chat eval split.
        """
        ev, out = self.cfg.eval, {}
        if "eval" in self.chat:
            out["eval/sft_loss"] = self.heldout_loss()
        if self.fleet is None:
            return out
        if not self.weights_synced:
            self.sync_weights()
        if self.games is not None:
            out.update(self.games.evaluate(greedy=ev.greedy))
        tasks = [t for splits in self.splits.values() if ev.split in splits
                 for t in splits[ev.split].tasks[: ev.num_samples]]
        groups = self.rollout(tasks, n=1, greedy=ev.greedy) if tasks else []  # every env in one loop
        for name in self.splits:
            trajs = [t for g in groups if g.task.env == name for t in g.trajectories]
            if trajs:
                out.update(episode_metrics(trajs, f"eval/{name}/"))
                out[f"eval/{name}/accuracy"] = out[f"eval/{name}/success_rate"]
        accs = [v for k, v in out.items() if k.endswith("/accuracy")]
        if accs:
            out["eval/accuracy"] = statistics.fmean(accs)
        return out

    # ------------------------------------------------------------------ logging

    def _log_trajectories(self, groups: list[TrajectoryGroup], advantage_of: dict[int, float]) -> None:
        """Log a few episodes per step; ``advantage`` is null for groups that were dropped."""
        self.log_episodes([t for g in groups for t in g.trajectories], advantage_of)

    def log_episodes(self, trajs: list[Trajectory], advantage_of: dict[int, float]) -> None:
        """Append decoded episodes to ``trajectories.jsonl`` and keep them for ``take_episodes``
        (the ResourceManager stores them for the dashboard's trajectory viewer)."""
        rows = [{"step": self.step, "task": t.task.id, "env": t.task.env, "agent": t.agent_id,
                 "messages": t.messages, "turn_rewards": t.turn_rewards, "reward": t.reward,
                 "advantage": advantage_of.get(id(t)), "finished": t.finished, "truncated": t.truncated,
                 "error": None if t.error is None else t.error.message,
                 "info": {k: v for k, v in t.info.items() if isinstance(v, (int, float, str, bool))}} for t in trajs]
        with (self.dir / "trajectories.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        self.pending_episodes.extend(rows)

    def take_episodes(self) -> list[dict[str, Any]]:
        out, self.pending_episodes = self.pending_episodes, []
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> str:
        """Learner state (+ job step and data position) and an exported HF/PEFT model."""
        import ray

        path = self.dir / "checkpoints" / f"step-{self.step:06d}"
        extra = {"job_step": self.step, "data": self.data_state()}
        ray.get(self.learner.save_state.remote(str(path / "state"), extra))
        ray.get(self.learner.export.remote(str(path / "model")))
        if self.games is not None:
            self.games.save(path)
        self.log(f"  checkpoint: {path}")
        return str(path)

    def resume(self, path: str) -> int:
        """Continue from a checkpoint: same step counter, same next batch, same weights."""
        import ray

        from otray.types import ModelLoadError

        state = Path(path) / "state"
        if not (state / "meta.json").exists():
            raise ModelLoadError(f"checkpoint.resume_from={path!r} holds no learner state ({state}/meta.json); "
                                 "give a directory like <job dir>/checkpoints/step-000010")
        meta = ray.get(self.learner.load_state.remote(str(state)))
        self.learner_version = ray.get(self.learner.info.remote())["policy_version"]
        self.step = meta["extra_state"]["job_step"]
        self.load_data_state(meta["extra_state"]["data"])
        self.sync_weights()
        if self.games is not None:
            self.games.load(Path(path))
        self.log(f"resumed from {path} at step {self.step}")
        return self.step

    def data_state(self) -> dict[str, Any]:
        """Where the job is in its data: the env mixture, the next game seed, the chat train split."""
        state: dict[str, Any] = {}
        if self.mixture is not None:
            state["mixture"] = self.data_before_prefetch if self.prefetched else self.mixture.state()
        if self.games is not None:
            state["game_seed"] = self.games.next_seed
        if self.cfg.job.kind == "sft":
            state["sft_position"] = list(self.chat["train"].position)
        return state

    def load_data_state(self, state: dict[str, Any]) -> None:
        if "mixture" in state:
            self.mixture.load_state(state["mixture"])
        if "game_seed" in state:
            self.games.next_seed = state["game_seed"]
        if "sft_position" in state:
            self.chat["train"].seek(tuple(state["sft_position"]))

    def write_metrics(self, row: dict[str, Any]) -> None:
        with (self.dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
