"""Episodes of the configured envs: :class:`EnvRollouts` (one agent loop over a fleet) and
:class:`EnvGroupSource` (the env mixture as a :class:`~otray.actors.job.step.GroupSource`).

Every env of a job rolls out in one :class:`~otray.actors.rollout.agent_loop.AgentLoop`
per call, so their generate calls batch together. Envs are created fresh per episode
from ``envs.<name>.entry`` + ``kwargs`` in this process (the job driver's). Episode
seeds derive from the job seed, the step and the episode's place in the batch, so a
rerun with the same seed draws the same episodes.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from otray import metric_keys as K
from otray.actors.job.episodes import batch_digest, episode_metrics, episode_reward
from otray.actors.job.step import Batch
from otray.config import Config, EnvSection, EvalSection
from otray.actors.rollout.agent_loop import AgentLoop, GenerateFn, Limits
from otray.actors.rollout.env_io import EnvIO
from otray.env import Mixture, TaskSource, resolve
from otray.types import ErrorRecord, SamplingParams, Task, Trajectory, TrajectoryGroup


class EnvRollouts:
    """Rolls out tasks of the job's envs through one agent loop over ``generate`` (a fleet's)."""

    def __init__(self, cfg: Config, tokenizer: Any, generate: GenerateFn, max_model_len: int):
        self.envs, self.seed = cfg.envs, cfg.job.seed
        self.tokenizer, self.generate, self.max_model_len = tokenizer, generate, max_model_len
        self.generate_s = 0.0  # inside generate calls, summed over every rollout
        self.last_generate_s = 0.0  # of the last rollout
        self.first_rollout_at: float | None = None  # wall clock (time.time) of the first rollout
        self._generate_s_run = 0.0

    def limits(self, env: EnvSection, factory_max_turns: int) -> Limits:
        return Limits(max_turns=env.max_turns or factory_max_turns, max_tokens_per_turn=env.max_tokens_per_turn,
                      max_tokens_per_episode=env.max_tokens_per_episode, max_model_len=self.max_model_len,
                      env_io=EnvIO(env.max_concurrency, env.timeout_s, env.episode_timeout_s))

    def rollout(self, tasks: list[Task], seed_step: int, *, n: int | None = None, greedy: bool = False,
                train: bool = False) -> list[TrajectoryGroup]:
        """``n`` (default: the env's ``num_rollouts``) episodes per task, every env in one agent loop;
        groups come back env by env in config order, keyed ``(env, task id)``, rewards reduced.

        ``train``: a failed rollout (an error, or no reward at all) is rolled out again, up to
        ``max_rollout_retries`` times, then taken out of its group into ``group.failed``; envs that
        score groups (``group_reward``) score them. Evaluation keeps every episode as it came."""
        if self.first_rollout_at is None:
            self.first_rollout_at = time.time()
        layout = [(name, env_cfg, [t for t in tasks if t.env == name]) for name, env_cfg in self.envs.items()]
        layout = [(name, env_cfg, mine, n or env_cfg.num_rollouts) for name, env_cfg, mine in layout if mine]
        slots = [(e, j, i) for e, (_, _, mine, k) in enumerate(layout) for j in range(len(mine)) for i in range(k)]
        trajs = self._run(layout, slots, seed_step, 0, greedy)
        self.last_generate_s = self._generate_s_run
        retries = max((env.max_rollout_retries for _, env, _, _ in layout), default=0) if train else 0
        for attempt in range(1, 1 + retries):
            again = [j for j, (k_env, _, _) in enumerate(slots)
                     if trajs[j].error is not None and attempt <= layout[k_env][1].max_rollout_retries]
            if not again:
                break
            for j, traj in zip(again, self._run(layout, [slots[j] for j in again], seed_step, attempt, greedy)):
                trajs[j] = traj
            self.last_generate_s += self._generate_s_run
        groups: list[TrajectoryGroup] = []
        members = iter(trajs)
        for name, env_cfg, mine, k in layout:
            for t in mine:
                group = [next(members) for _ in range(k)]
                failed = [tr for tr in group if tr.error is not None] if train else []
                kept = [tr for tr in group if tr.error is None] if train else group
                groups.append(TrajectoryGroup(t, kept, key=(name, t.id), max_failing=env_cfg.max_failing_rollouts,
                                              failed=failed))
                if train and env_cfg.group_reward != "none":
                    self._score_group(groups[-1], env_cfg)
        return groups

    def _run(self, layout: list, slots: list[tuple[int, int, int]], seed_step: int, attempt: int,
             greedy: bool) -> list[Trajectory]:
        """One agent loop over ``slots`` (env index, task index, rollout index; in env order); rewards
        reduced, episodes with no reward at all marked failed. Seeds derive from the job seed, the
        step, the env's place, the task's and the rollout's (and the retry ``attempt``)."""
        batches = []
        for e, (name, env_cfg, mine, k) in enumerate(layout):
            factory = resolve(env_cfg.entry)
            base = self.seed * 1_000_003 + seed_step * 100_003 + e * 10_007 + attempt * 7_919
            episodes = [(mine[j], factory(**env_cfg.kwargs), base + j * k + i) for e2, j, i in slots if e2 == e]
            if not episodes:
                continue
            params = SamplingParams(max_tokens=env_cfg.max_tokens_per_turn, ignore_eos=env_cfg.ignore_eos,
                                    temperature=0.0 if greedy else env_cfg.temperature, top_p=env_cfg.top_p,
                                    min_p=env_cfg.min_p, stop=tuple(env_cfg.stop))
            batches.append((episodes, params, self.limits(env_cfg, episodes[0][1].max_turns)))
        loop = AgentLoop(self.tokenizer, self.generate, Limits())
        trajs = loop.run_many(batches)  # in the order of the batches: env by env, as ``slots`` is
        self.generate_s += loop.generate_s
        self._generate_s_run = loop.generate_s
        for (e, _, _), traj in zip(slots, trajs):
            reward = episode_reward(traj, layout[e][1])
            if reward is None:
                traj.error = ErrorRecord("no_reward", "the episode gave no reward: every turn's reward was None"
                                         + ("" if traj.finished else " and envs.<name>.nonterminal_reward is null"),
                                         turn=traj.num_turns)
            traj.reward = reward or 0.0
        return trajs

    def _score_group(self, group: TrajectoryGroup, env_cfg: EnvSection) -> None:
        """Combine the env's group score (``score_group(task, trajectories) -> rewards``) with each
        rollout's reward as ``group_reward`` says; a failing scorer fails the whole group."""
        if not group.trajectories:
            return
        env = resolve(env_cfg.entry)(**env_cfg.kwargs)
        try:
            scores = [float(x) for x in env.score_group(group.task, group.trajectories)]
            if len(scores) != len(group.trajectories):
                raise ValueError(f"score_group returned {len(scores)} scores for {len(group.trajectories)} rollouts")
        except Exception as e:  # noqa: BLE001 - the group is recorded as failed, the step goes on
            for traj in group.trajectories:
                traj.error = ErrorRecord("group_score_failed", f"{type(e).__name__}: {e}"[:2000], turn=traj.num_turns)
            group.failed.extend(group.trajectories)
            group.trajectories = []
            return
        finally:
            env.close()
        for traj, score in zip(group.trajectories, scores):
            traj.info["group_score"] = score
            traj.reward = score if env_cfg.group_reward == "replace" else traj.reward + score

    def accuracy(self, tasks: list[Task], seed_step: int, greedy: bool = True) -> float:
        """Share of ``tasks`` solved in one episode each (info["correct"], else reward > 0)."""
        from otray.actors.job.episodes import solved

        trajs = [t for g in self.rollout(tasks, seed_step, n=1, greedy=greedy) for t in g.trajectories]
        return statistics.fmean(map(solved, trajs))

    def evaluate(self, splits: dict[str, dict[str, TaskSource]], ev: EvalSection, step: int) -> dict[str, float]:
        """One episode per task of each env's ``ev.split`` (first ``ev.num_samples``), all envs in one loop:
        ``eval/<env>/...`` metrics, ``eval/<env>/accuracy`` = success rate, ``eval/accuracy`` their mean
        and ``eval/accuracy_stderr`` its standard error (the envs' binomial errors combined)."""
        tasks = [t for s in splits.values() if ev.split in s for t in s[ev.split].tasks[: ev.num_samples]]
        groups = self.rollout(tasks, step, n=1, greedy=ev.greedy) if tasks else []
        out: dict[str, float] = {}
        variances = []
        for name in splits:
            trajs = [t for g in groups if g.task.env == name for t in g.trajectories]
            if trajs:
                out.update(episode_metrics(trajs, f"eval/{name}/"))
                p = out[f"eval/{name}/accuracy"] = out[f"eval/{name}/success_rate"]
                variances.append(p * (1 - p) / len(trajs))
        if variances:
            out[K.EVAL_ACCURACY] = statistics.fmean(v for k, v in out.items() if k.endswith("/accuracy"))
            out[K.EVAL_STDERR] = math.sqrt(sum(variances)) / len(variances)
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
        groups = self.rollouts.rollout(tasks, seed_step, train=True)
        trajs = [t for g in groups for t in g.all_trajectories]
        metrics = episode_metrics(trajs, "")
        for name in self.cfg.envs if len(self.cfg.envs) > 1 else ():  # per env, when there are several
            mine = [t for g in groups if g.task.env == name for t in g.all_trajectories]
            if mine:
                metrics.update(episode_metrics(mine, f"env/{name}/"))
        return Batch({self.policy: groups}, batch_digest(tasks), time.perf_counter() - t0, sample_s,
                     self.rollouts.last_generate_s, sum(t.num_sampled for t in trajs), metrics,
                     shown=[t for g in groups[:2] for t in g.all_trajectories])

    def evaluate(self, step: int, greedy: bool) -> dict[str, float]:
        from dataclasses import replace

        return self.rollouts.evaluate(self.splits, replace(self.cfg.eval, greedy=greedy), step)

    def state(self) -> dict[str, Any]:
        return {"mixture": self.mixture.state()}

    def lasting_state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        if "mixture" in state:
            self.mixture.load_state(state["mixture"])
