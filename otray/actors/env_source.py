"""Episodes of the configured envs: :class:`EnvRollouts` (one agent loop over a fleet) and
:class:`EnvGroupSource` (the env mixture as a :class:`~otray.actors.step.GroupSource`).

Every env of a job rolls out in one :class:`~otray.coordinator.agent_loop.AgentLoop`
per call, so their generate calls batch together. Envs are created fresh per episode
from ``envs.<name>.entry`` + ``kwargs`` in this process (the job driver's). Episode
seeds derive from the job seed, the step and the episode's place in the batch, so a
rerun with the same seed draws the same episodes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from otray.actors.episodes import batch_digest, episode_metrics, episode_reward
from otray.actors.step import Batch
from otray.config import Config, EnvSection, EvalSection
from otray.coordinator.agent_loop import AgentLoop, GenerateFn, Limits
from otray.env import Mixture, TaskSource, resolve
from otray.types import SamplingParams, Task, TrajectoryGroup


class EnvRollouts:
    """Rolls out tasks of the job's envs through one agent loop over ``generate`` (a fleet's)."""

    def __init__(self, cfg: Config, tokenizer: Any, generate: GenerateFn, max_model_len: int):
        self.envs, self.seed = cfg.envs, cfg.job.seed
        self.tokenizer, self.generate, self.max_model_len = tokenizer, generate, max_model_len
        self.generate_s = 0.0  # inside generate calls, summed over every rollout
        self.last_generate_s = 0.0  # of the last rollout
        self.first_rollout_at: float | None = None  # wall clock (time.time) of the first rollout

    def limits(self, env: EnvSection, factory_max_turns: int) -> Limits:
        return Limits(max_turns=env.max_turns or factory_max_turns, max_tokens_per_turn=env.max_tokens_per_turn,
                      max_tokens_per_episode=env.max_tokens_per_episode, max_model_len=self.max_model_len)

    def rollout(self, tasks: list[Task], seed_step: int, *, n: int | None = None,
                greedy: bool = False) -> list[TrajectoryGroup]:
        """``n`` (default: the env's ``num_rollouts``) episodes per task, every env in one agent loop;
        groups come back env by env in config order, keyed ``(env, task id)``, rewards reduced."""
        if self.first_rollout_at is None:
            self.first_rollout_at = time.time()
        batches, layout = [], []
        for name, env_cfg in self.envs.items():
            mine = [t for t in tasks if t.env == name]
            if not mine:
                continue
            factory, k = resolve(env_cfg.entry), n or env_cfg.num_rollouts
            base = self.seed * 1_000_003 + seed_step * 100_003 + len(layout) * 10_007
            episodes = [(t, factory(**env_cfg.kwargs), base + j * k + i) for j, t in enumerate(mine) for i in range(k)]
            params = SamplingParams(max_tokens=env_cfg.max_tokens_per_turn, ignore_eos=env_cfg.ignore_eos,
                                    temperature=0.0 if greedy else env_cfg.temperature, top_p=env_cfg.top_p)
            batches.append((episodes, params, self.limits(env_cfg, episodes[0][1].max_turns)))
            layout.append((name, env_cfg, mine, k))
        loop = AgentLoop(self.tokenizer, self.generate, Limits())
        trajs = iter(loop.run_many(batches))
        self.generate_s += loop.generate_s
        self.last_generate_s = loop.generate_s
        groups: list[TrajectoryGroup] = []
        for name, env_cfg, mine, k in layout:
            for t in mine:
                members = [next(trajs) for _ in range(k)]
                for traj in members:
                    traj.reward = episode_reward(traj, env_cfg)
                groups.append(TrajectoryGroup(t, members, key=(name, t.id), max_failing=env_cfg.max_failing_rollouts))
        return groups

    def accuracy(self, tasks: list[Task], seed_step: int, greedy: bool = True) -> float:
        """Share of ``tasks`` solved in one episode each (info["correct"], else reward > 0)."""
        from otray.actors.episodes import solved

        trajs = [t for g in self.rollout(tasks, seed_step, n=1, greedy=greedy) for t in g.trajectories]
        return statistics.fmean(map(solved, trajs))

    def evaluate(self, splits: dict[str, dict[str, TaskSource]], ev: EvalSection, step: int) -> dict[str, float]:
        """One episode per task of each env's ``ev.split`` (first ``ev.num_samples``), all envs in one loop:
        ``eval/<env>/...`` metrics, ``eval/<env>/accuracy`` = success rate, ``eval/accuracy`` their mean."""
        tasks = [t for s in splits.values() if ev.split in s for t in s[ev.split].tasks[: ev.num_samples]]
        groups = self.rollout(tasks, step, n=1, greedy=ev.greedy) if tasks else []
        out: dict[str, float] = {}
        for name in splits:
            trajs = [t for g in groups if g.task.env == name for t in g.trajectories]
            if trajs:
                out.update(episode_metrics(trajs, f"eval/{name}/"))
                out[f"eval/{name}/accuracy"] = out[f"eval/{name}/success_rate"]
        accs = [v for k, v in out.items() if k.endswith("/accuracy")]
        if accs:
            out["eval/accuracy"] = statistics.fmean(accs)
        return out


class EnvGroupSource:
    """The env mixture as a GroupSource: ``algo.batch_size`` tasks a step, drawn from the envs' train
    splits by weight, each rolled out ``num_rollouts`` times for the job's one trained policy."""

    def __init__(self, cfg: Config, rollouts: EnvRollouts, splits: dict[str, dict[str, TaskSource]],
                 policy: str = "main"):
        self.cfg, self.rollouts, self.splits, self.policy = cfg, rollouts, splits, policy
        self.mixture = Mixture({n: s["train"] for n, s in splits.items()},
                               {n: e.weight for n, e in cfg.envs.items()}, seed=cfg.job.seed)

    def next_batch(self, seed_step: int) -> Batch:
        t0 = time.perf_counter()
        tasks = self.mixture.sample(self.cfg.algo.batch_size)
        sample_s = time.perf_counter() - t0
        groups = self.rollouts.rollout(tasks, seed_step)
        trajs = [t for g in groups for t in g.trajectories]
        metrics = episode_metrics(trajs, "")
        for name in self.cfg.envs if len(self.cfg.envs) > 1 else ():  # per env, when there are several
            mine = [t for g in groups if g.task.env == name for t in g.trajectories]
            if mine:
                metrics.update(episode_metrics(mine, f"env/{name}/"))
        return Batch({self.policy: groups}, batch_digest(tasks), time.perf_counter() - t0, sample_s,
                     self.rollouts.last_generate_s, sum(t.num_sampled for t in trajs), metrics,
                     shown=[t for g in groups[:2] for t in g.trajectories])

    def evaluate(self, step: int, greedy: bool) -> dict[str, float]:
        from dataclasses import replace

        return self.rollouts.evaluate(self.splits, replace(self.cfg.eval, greedy=greedy), step)

    def state(self) -> dict[str, Any]:
        return {"mixture": self.mixture.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        if "mixture" in state:
            self.mixture.load_state(state["mixture"])
