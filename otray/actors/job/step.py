"""The RL step, one for envs and games: ``rl_step(pipeline, policies, algo, step)``.

A :class:`GroupSource` turns a step into trajectory groups: the env mixture through the
agent loop (``otray/actors/job/env_source.py``), or game seeds through the
ProtocolCoordinator actor (``otray/actors/job/game_source.py``). The step does the same to
either: select groups, advantages, datums (``otray.algos.groups``), update every trained
policy's learner, push weights, and report one metrics row. The one-step-off-policy
pipeline (``algo.max_steps_off_policy: 1``) lives in :class:`Prefetcher`: the next batch
is rolled out in a background thread while the learners train, and weights are pushed
once both are done, so every batch is exactly one policy version old.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from otray import metric_keys as K
from otray.actors.job.runtime import Objective, PolicyRuntime
from otray.algos.groups import prepare, select_groups
from otray.algos.schedule import learning_rate
from otray.config import AlgoSection
from otray.timing import StepClock
from otray.types import RolloutError, Trajectory, TrajectoryGroup, WorkersLostError


@dataclass
class Batch:
    """One step's rollouts: each trained policy's groups, what they cost, and the source's metrics."""

    groups: dict[str, list[TrajectoryGroup]]  # trained policy name -> its groups
    digest: str  # which data: a fingerprint of the task ids, or the game seeds
    rollout_s: float  # wall time of the whole rollout (sampling the tasks included)
    sample_s: float  # of which: drawing the tasks
    generate_s: float  # of which: inside generate calls
    sampled: int  # tokens sampled
    metrics: dict[str, Any] = field(default_factory=dict)  # the source's own: rewards, success, outcomes
    shown: list[Trajectory] = field(default_factory=list)  # a few episodes for the log


class GroupSource(Protocol):
    """Where a job's trajectory groups come from (env mixture, or games) and how its policy is evaluated."""

    def next_batch(self, seed_step: int) -> Batch:
        """Roll out the next batch; episode seeds derive from the job seed and ``seed_step``."""

    def evaluate(self, step: int, greedy: bool) -> dict[str, float]:
        """Held-out metrics (``eval/...``), ``eval/accuracy`` the headline figure."""

    def state(self) -> dict[str, Any]:
        """The data position (saved with checkpoints so a resumed job draws the same next batch)."""

    def lasting_state(self) -> dict[str, Any]:
        """What else a resumed job needs, as it is now rather than at the data position (a game's Elo table)."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Both of the above, as saved."""


class Prefetcher:
    """Hands the step its batch: rolled out now (on-policy), or, with ``ahead=1``, rolled out in a
    background thread while the previous step trained. A checkpoint taken while a batch is in flight
    saves the data position before it (:meth:`state`), so a resumed job samples it again."""

    def __init__(self, source: GroupSource, ahead: int = 0):
        self.source, self.ahead = source, ahead
        self.pending: Future[Batch] | None = None
        self.state_before: dict[str, Any] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if ahead else None

    def take(self, seed_step: int, clock: StepClock) -> Batch:
        """This step's batch; marks ``rollout_wait`` (prefetched) or ``sample``/``generate``/``env``."""
        if self.pending is not None:
            batch, self.pending = self.pending.result(), None
            clock.mark("rollout_wait")
            return batch
        batch = self.source.next_batch(seed_step)
        clock.mark("env")
        clock.add("sample", batch.sample_s, out_of="env")
        clock.add("generate", batch.generate_s, out_of="env")
        return batch

    def start_next(self, seed_step: int) -> None:
        """Off-policy: start rolling out the next batch with the workers' current weights."""
        if self.pool is not None:
            self.state_before = self.source.state()
            self.pending = self.pool.submit(self.source.next_batch, seed_step)

    def wait(self, clock: StepClock) -> None:
        """Off-policy: wait until the next batch is rolled out (before new weights may be pushed)."""
        if self.pending is not None:
            self.pending.result()
            clock.mark("rollout_wait")

    def state(self) -> dict[str, Any]:
        position = self.state_before if self.pending is not None else self.source.state()
        return {**position, **self.source.lasting_state()}


@dataclass
class StepMetrics:
    """What one RL step reports: its metrics row (time parts still open on ``clock``), the episodes to
    log with their advantages, and, off-policy, the generate time of the batch it trained on."""

    row: dict[str, Any]
    clock: StepClock
    shown: list[Trajectory]
    advantage_of: dict[int, float]
    generate_s: float | None = None


def check_batch(batch: Batch, step: int) -> None:
    """Raise RolloutError when every rollout of the batch failed: a step with nothing to train on is
    a broken job (dead workers, an env failing every episode), never a silent success."""
    every = [t for groups in batch.groups.values() for g in groups for t in g.all_trajectories]
    failed = [t for t in every if t.error is not None]
    if every and len(failed) < len(every):
        return
    kinds = sorted({t.error.kind for t in failed})
    first = f"; the first: {failed[0].error.kind}: {failed[0].error.message}" if failed else ""
    # every rollout lost to dead workers: a death (healed by a restart, job.max_failures), not the envs' failing
    lost = bool(failed) and all(t.error.message.startswith(f"{WorkersLostError.__name__}:") for t in failed)
    raise (WorkersLostError if lost else RolloutError)(
        f"step {step}: all {len(every)} rollouts failed ({', '.join(kinds) or 'none came back'})"
        f"{first}. Nothing to train on, so the job stops here without a checkpoint of this step")


def logprob_gap(learner_metrics: dict[str, Any]) -> dict[str, float]:
    """The sampler/learner logprob gap of a step (what the learner's forward_backward measured)."""
    if "logprob_diff_max" not in learner_metrics:
        return {}
    return {K.LOGPROB_DIFF_MAX: learner_metrics["logprob_diff_max"],
            K.LOGPROB_DIFF_MEAN: learner_metrics["logprob_diff_mean"], K.LOGPROB_KL: learner_metrics["approx_kl"]}


def rl_step(pipeline: Prefetcher, policies: dict[str, PolicyRuntime], algo: AlgoSection, step: int,
            clock: StepClock | None = None) -> StepMetrics:
    """One RL step: the batch, then for every trained policy groups -> advantages -> datums -> update,
    then weights pushed. ``step`` counts the steps done before this one; ``clock`` is the step's clock when
    the caller started it earlier (its parts so far count in the step)."""
    clock, objective = clock or StepClock(), Objective.of(algo)
    batch = pipeline.take(step, clock)                                              # 1-3. tasks, episodes, rewards
    check_batch(batch, step + 1)                                                    #    (all failed: stop)
    chosen = {name: select_groups(batch.groups.get(name, []), algo.drop_uniform_groups)  # 4. drop failing and
              for name in policies}                                                 #    uniform groups
    prepared = {name: prepare(sel, algo.advantage) for name, sel in chosen.items()}  # 5. advantages, datums
    clock.mark("prepare")
    pipeline.start_next(step + 1)                                                   # (off-policy: next batch now)
    learned: dict[str, dict[str, Any]] = {}
    lr = learning_rate(algo, step + 1)                                              #    (algo.lr_schedule)
    for name, policy in policies.items():                                           # 6. learn
        t0 = time.perf_counter()
        out = policy.update(prepared[name].datums, objective, algo, lr, prepared[name].normalizer, clock,
                            kl_to_start=algo.kl_coeff, rl=True)                   #    (algo.grad_clip_relative)
        learned[name] = {"learn_s": time.perf_counter() - t0, **{f"learner/{k}": v for k, v in out.items()},
                         **logprob_gap(out)}
    pipeline.wait(clock)                                                            # 7. push weights (off-policy:
    for name, policy in policies.items():                                           #    once the next batch is
        learned[name]["sync_s"] = 0.0 if policy.synced else policy.sync_weights(clock)  # done: one version old)
        learned[name][K.WEIGHT_SYNC] = policy.weight_sync
        learned[name][K.SAMPLER], learned[name][K.SAMPLER_COMPILE_S] = policy.info.sampler, policy.info.compile_s
    row: dict[str, Any] = {"step": step + 1, "batch": batch.digest, **batch.metrics}  # 8. metrics
    for name, policy in policies.items():
        prefix = "" if len(policies) == 1 else f"policy/{name}/"
        trajs = prepared[name].trajectories
        lag = policy.version - 1 - min(t.policy_version for t in trajs) if trajs else 0
        row.update({prefix + k: v for k, v in {**chosen[name].counts(), K.POLICY_LAG: lag, **learned[name]}.items()})
    row.update({K.TOKENS_PER_S: batch.sampled / max(batch.rollout_s, 1e-9), "rollout_s": batch.rollout_s,
                "generate_s": batch.generate_s})
    advantage_of = {k: v for p in prepared.values() for k, v in p.advantage_of().items()}
    return StepMetrics(row, clock, batch.shown, advantage_of,
                       generate_s=batch.generate_s if algo.max_steps_off_policy else None)
