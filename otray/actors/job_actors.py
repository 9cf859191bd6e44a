"""What training and inference jobs share: their actors and their rollouts.

:class:`JobActors` creates a job's PolicyLearner and RolloutWorkers in the job's
placement group (one bundle each, with their torch thread counts set from process
start) and rolls out episodes of the configured envs through one agent loop. The
functions around it turn episodes into rewards and metrics and load an env's splits.
Used by :class:`otray.actors.job.TrainJob` and :class:`otray.actors.inference.InferenceJob`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from otray.config import DatasetSection, EnvSection, SplitSection, import_object, to_dict
from otray.coordinator.agent_loop import AgentLoop, Limits
from otray.env import TaskSource, resolve, split_seed
from otray.types import DatasetError, SamplingParams, Task, Trajectory, TrajectoryGroup

REDUCE: dict[str, Callable[[list[float]], float]] = {
    "sum": sum, "mean": statistics.fmean, "max": max, "min": min}


def episode_reward(traj: Trajectory, env: EnvSection) -> float:
    """Reduce per-turn rewards; add ``nonterminal_reward`` if the episode never finished."""
    if traj.error is not None:
        return 0.0
    reward = REDUCE[env.reward_reduction](traj.turn_rewards) if traj.turn_rewards else 0.0
    return reward if traj.finished else reward + env.nonterminal_reward


def solved(traj: Trajectory) -> bool:
    """An episode counts as solved when the env says ``info["correct"]``, else when rewarded."""
    return bool(traj.info.get("correct", traj.reward > 0))


def episode_metrics(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """Mean reward, success rate, mean turns, error count and, for tool envs (``info["tool_calls"]``),
    tool calls per episode and the share of them that failed."""
    out = {f"{prefix}reward_mean": statistics.fmean(t.reward for t in trajs),
           f"{prefix}success_rate": statistics.fmean(map(solved, trajs)),
           f"{prefix}turns_mean": statistics.fmean(t.num_turns for t in trajs),
           f"{prefix}episode_errors": float(sum(t.error is not None for t in trajs))}
    calls = sum(int(t.info.get("tool_calls", 0)) for t in trajs)
    if any("tool_calls" in t.info for t in trajs):
        out[f"{prefix}tool_calls_mean"] = calls / len(trajs)
        out[f"{prefix}tool_error_rate"] = sum(int(t.info.get("tool_errors", 0)) for t in trajs) / max(1, calls)
    return out


def load_splits(name: str, dataset: DatasetSection, splits: dict[str, SplitSection], seed: int,
                where: str) -> dict[str, TaskSource]:
    """Task sources of one env (or of SFT chat data): explicit split paths, else the builder's output."""
    built: dict[str, Any] = {}
    if dataset.builder:
        built = import_object(dataset.builder)(dataset.dir, **dataset.kwargs)
    sources = {}
    for split, sc in splits.items():
        if dataset.generator and not sc.path:
            sources[split] = TaskSource.from_generator(import_object(dataset.generator), sc.num_samples or 1000, name,
                                                       seed=split_seed(seed, split), shuffle=sc.shuffle)
            continue
        path = sc.path or built.get(split)
        if path is None:
            raise DatasetError(f"{where}.splits.{split} has no path and the dataset builder made no {split!r} split")
        sources[split] = TaskSource.from_file(path, name, limit=sc.num_samples, shuffle=sc.shuffle, seed=seed)
    return sources


def in_bundle(placement_group: Any, index: int) -> dict[str, Any]:
    """Actor options that pin an actor to one bundle of the job's placement group (or nothing)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=index)}


def threads_env(num_threads: int | None) -> dict[str, Any]:
    """Actor options that give an actor's OpenMP ``num_threads`` threads from process start.

    Ray sets ``OMP_NUM_THREADS`` to the actor's ``num_cpus``; ``torch.set_num_threads``
    raises torch's own count later, but measured here (2 cores, learner with
    ``num_cpus=1`` and 2 threads) forward_backward still ran ~8% slower than with the
    variable set to 2 up front. Ray merges these ``env_vars`` into the job's runtime env.
    """
    if not num_threads:
        return {}
    n = str(num_threads)
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}}}


class JobActors:
    """What training and inference jobs share: creating their actors in the job's placement group and
    rolling out episodes of the configured envs. Needs ``cfg``, ``model_path``, ``tokenizer``,
    ``placement_group``, ``fleet``, ``worker_info``, ``step``, ``generate_s``, ``first_rollout_at``."""

    def make_learner(self, bundle: int) -> Any:
        """A PolicyLearner for this job's model in placement-group bundle ``bundle``."""
        import ray

        from otray.actors.learner import PolicyLearner

        cfg, res = self.cfg, self.cfg.resources
        return ray.remote(num_cpus=res.learner_cpus, num_gpus=res.learner_gpus)(PolicyLearner).options(
            **in_bundle(self.placement_group, bundle), **threads_env(res.learner_threads)).remote(
            self.model_path, lora=to_dict(cfg)["model"]["lora"], dtype=cfg.model.dtype,
            micro_batch_tokens=cfg.algo.micro_batch_tokens, seed=cfg.job.seed, num_threads=res.learner_threads)

    def make_workers(self, first_bundle: int, n: int, model_path: str) -> list[Any]:
        """``n`` RolloutWorkers serving ``model_path``, in bundles ``first_bundle``, ``first_bundle + 1``, ..."""
        import ray

        from otray.actors.rollout import RolloutWorker

        cfg, res = self.cfg, self.cfg.resources
        return [ray.remote(num_cpus=res.rollout_cpus, num_gpus=res.rollout_gpus)(RolloutWorker).options(
            **in_bundle(self.placement_group, first_bundle + i), **threads_env(res.rollout_threads)).remote(
            model_path, cfg.rollout.backend, num_threads=res.rollout_threads, dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len, seed=cfg.job.seed + i, max_lora_rank=cfg.model.lora.rank,
            kv_cache_gb=cfg.rollout.kv_cache_gb, max_batch=cfg.rollout.max_batch) for i in range(n)]

    # ------------------------------------------------------------------ rollouts

    def limits(self, env: EnvSection, factory_max_turns: int) -> Limits:
        return Limits(max_turns=env.max_turns or factory_max_turns, max_tokens_per_turn=env.max_tokens_per_turn,
                      max_tokens_per_episode=env.max_tokens_per_episode,
                      max_model_len=self.worker_info["max_model_len"])

    def rollout(self, tasks: list[Task], *, n: int | None = None, greedy: bool = False,
                seed_step: int | None = None) -> list[TrajectoryGroup]:
        """Roll out ``n`` (default: the env's ``num_rollouts``) episodes per task, every env in one agent loop
        (their generate calls batch together); groups come back env by env in config order. Episode
        seeds derive from the job seed and ``seed_step`` (default: the current step)."""
        if self.first_rollout_at is None:
            self.first_rollout_at = time.time()
        batches, layout = [], []
        for name, env_cfg in self.cfg.envs.items():
            mine = [t for t in tasks if t.env == name]
            if not mine:
                continue
            factory, k = resolve(env_cfg.entry), n or env_cfg.num_rollouts
            step = self.step if seed_step is None else seed_step
            base = self.cfg.job.seed * 1_000_003 + step * 100_003 + len(layout) * 10_007
            episodes = [(t, factory(**env_cfg.kwargs), base + j * k + i) for j, t in enumerate(mine) for i in range(k)]
            params = SamplingParams(max_tokens=env_cfg.max_tokens_per_turn, ignore_eos=env_cfg.ignore_eos,
                                    temperature=0.0 if greedy else env_cfg.temperature, top_p=env_cfg.top_p)
            batches.append((episodes, params, self.limits(env_cfg, episodes[0][1].max_turns)))
            layout.append((env_cfg, mine, k))
        loop = AgentLoop(self.tokenizer, self.fleet.generate, Limits())
        trajs = iter(loop.run_many(batches))
        self.generate_s += loop.generate_s
        self.last_rollout_generate_s = loop.generate_s
        groups: list[TrajectoryGroup] = []
        for env_cfg, mine, k in layout:
            for t in mine:
                members = [next(trajs) for _ in range(k)]
                for traj in members:
                    traj.reward = episode_reward(traj, env_cfg)
                groups.append(TrajectoryGroup(t, members))
        return groups
