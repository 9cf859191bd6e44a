"""From a step's trajectory groups to the learner's datums: the pure part of the RL step.

Env jobs and game jobs hand the step the same thing, a list of
:class:`~otray.types.TrajectoryGroup` (the rollouts of one task, or one role's
trajectories in the games of one seed and seating), and the step treats both alike:

1. :func:`select_groups` drops the groups with more failed rollouts than they may
   hold (``max_failing``) and, with ``drop_uniform``, the groups whose rewards are all
   equal (their advantages are all zero: no gradient, only compute);
2. :func:`prepare` computes each kept group's advantages, builds the datums and the
   :class:`~otray.types.LossNormalizer` that counts the dropped uniform groups' tokens
   too, so that dropping them leaves the gradient as if they had been trained on.

Nothing here needs Ray or torch; ``tests/algos/test_groups.py`` checks it against hand-computed values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from otray.algos import advantages as adv
from otray.algos.datums import build_datums
from otray.types import Datum, LossNormalizer, Trajectory, TrajectoryGroup


def is_uniform(group: TrajectoryGroup) -> bool:
    """Every reward in the group is the same (group-relative advantages are all zero)."""
    return len(set(group.rewards)) <= 1


def is_failing(group: TrajectoryGroup) -> bool:
    """The group holds more errored rollouts than it may (``group.max_failing``)."""
    return group.num_failed > group.max_failing


@dataclass
class Selection:
    """Which of a step's groups are trained on, and why the others are not."""

    kept: list[TrajectoryGroup]
    uniform: list[TrajectoryGroup]  # dropped: equal rewards (only with drop_uniform)
    failing: list[TrajectoryGroup]  # dropped: too many failed rollouts
    equal_rewards: int  # groups of the step whose rewards were all equal, dropped or not

    def counts(self) -> dict[str, int]:
        """The step's group metrics: ``groups_kept``, ``groups_dropped_failing`` and
        ``groups_dropped_uniform`` (the groups with all rewards equal, failing ones included;
        they are dropped when ``algo.drop_uniform_groups`` is on)."""
        return {"groups_kept": len(self.kept), "groups_dropped_uniform": self.equal_rewards,
                "groups_dropped_failing": len(self.failing)}


def select_groups(groups: Sequence[TrajectoryGroup], drop_uniform: bool) -> Selection:
    """Split ``groups`` into kept, dropped-uniform and dropped-failing (failing wins over uniform)."""
    kept, uniform, failing = [], [], []
    for g in groups:
        if is_failing(g):
            failing.append(g)
        elif drop_uniform and is_uniform(g):
            uniform.append(g)
        else:
            kept.append(g)
    return Selection(kept, uniform, failing, sum(map(is_uniform, groups)))


def loss_normalizer(datums: Sequence[Datum], dropped: Sequence[TrajectoryGroup]) -> LossNormalizer:
    """What the loss divides by: the tokens and sequences of the whole batch, the groups dropped for
    having equal rewards included. Their advantages are all zero, so training on them adds nothing
    to the loss's sum; counting them here makes dropping them save compute without changing the
    gradient (as if every group had been trained on)."""
    skipped = build_datums([t for g in dropped for t in g.trajectories],
                           [0.0 for g in dropped for _ in g.trajectories])
    both = [*datums, *skipped]
    return LossNormalizer(tokens=float(sum(sum(d.mask) for d in both)), sequences=float(len(both)))


@dataclass
class Prepared:
    """One policy's training input for a step: the kept trajectories with their advantages (same
    order), the datums built from them, and the loss normalizer."""

    trajectories: list[Trajectory]
    advantages: list[float]
    datums: list[Datum]
    normalizer: LossNormalizer

    def advantage_of(self) -> dict[int, float]:
        """``id(trajectory) -> advantage`` for logging (trajectories of dropped groups have none)."""
        return {id(t): a for t, a in zip(self.trajectories, self.advantages)}


def prepare(selection: Selection, estimator: str) -> Prepared:
    """Advantages of each kept group (``estimator``: mean | zscore | rloo), datums, normalizer."""
    trajs, advantages = [], []
    for g in selection.kept:
        trajs.extend(g.trajectories)
        advantages.extend(adv.compute(estimator, g.rewards))
    datums = build_datums(trajs, advantages)
    return Prepared(trajs, advantages, datums, loss_normalizer(datums, selection.uniform))
