"""The pure part of the RL step (otray.algos.groups): which groups are trained on, their advantages,
datums and loss normalizer, checked against hand-computed values without Ray or a model."""

import math

import pytest

from otray.algos.groups import loss_normalizer, prepare, select_groups
from otray.types import ErrorRecord, LossNormalizer, Task, Trajectory, TrajectoryGroup


def traj(reward: float, sampled: int = 2, prompt: int = 3, error: bool = False) -> Trajectory:
    t = Trajectory(task=Task("t", "e"), reward=reward)
    t.append(list(range(prompt)), sampled=False)
    t.append(list(range(sampled)), sampled=True, logprobs=[-0.5] * sampled)
    if error:
        t.error = ErrorRecord("env_exception", "boom")
    return t


def group(*rewards: float, failed: int = 0, max_failing: int = 0, key=("e", "t")) -> TrajectoryGroup:
    members = [traj(r) for r in rewards] + [traj(0.0, error=True) for _ in range(failed)]
    return TrajectoryGroup(Task(str(key), "e"), members, key=key, max_failing=max_failing)


def test_select_groups_drops_failing_before_uniform_and_counts_both():
    mixed, uniform = group(1.0, 0.0), group(1.0, 1.0)
    failing_mixed = group(1.0, 0.0, failed=1)  # one failure, none allowed
    failing_uniform = group(0.0, failed=1)  # all rewards 0.0, and failing
    tolerated = group(1.0, 0.0, failed=1, max_failing=1)
    sel = select_groups([mixed, uniform, failing_mixed, failing_uniform, tolerated], drop_uniform=True)
    assert sel.kept == [mixed, tolerated]
    assert sel.uniform == [uniform] and sel.failing == [failing_mixed, failing_uniform]
    # groups_dropped_uniform counts every all-equal group of the step, failing ones too (as before the change)
    assert sel.counts() == {"groups_kept": 2, "groups_dropped_uniform": 2, "groups_dropped_failing": 2}


def test_without_drop_uniform_uniform_groups_are_trained_on():
    uniform = group(1.0, 1.0)
    sel = select_groups([uniform, group(0.0, 1.0)], drop_uniform=False)
    assert len(sel.kept) == 2 and sel.uniform == [] and sel.counts()["groups_dropped_uniform"] == 1


@pytest.mark.parametrize("estimator, expected", [
    ("mean", [0.5, -0.5, 0.0, 0.0]),
    ("zscore", [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0]),
    ("rloo", [1.0, -1.0, 0.0, 0.0])])
def test_prepare_gives_each_kept_group_its_own_advantages(estimator, expected):
    a, b = group(1.0, 0.0), group(2.0, 2.0)  # b is uniform but kept (drop_uniform off): advantages 0
    p = prepare(select_groups([a, b], drop_uniform=False), estimator)
    assert p.trajectories == [*a.trajectories, *b.trajectories]
    assert p.advantages == pytest.approx(expected)
    # one datum per trajectory: 5 tokens -> 4 targets, the 2 sampled ones carry the advantage
    assert [d.advantages for d in p.datums] == [[0.0, 0.0, x, x] for x in p.advantages]
    assert [d.mask for d in p.datums] == [[0.0, 0.0, 1.0, 1.0]] * 4
    assert p.normalizer == LossNormalizer(tokens=8.0, sequences=4.0)
    assert p.advantage_of()[id(a.trajectories[0])] == pytest.approx(expected[0])


def test_normalizer_counts_dropped_uniform_groups_and_not_failing_ones():
    kept, uniform, failing = group(1.0, 0.0), group(1.0, 1.0, 1.0), group(1.0, 0.0, failed=2)
    p = prepare(select_groups([kept, uniform, failing], drop_uniform=True), "zscore")
    assert len(p.datums) == 2  # only the kept group is sent to the learner
    assert p.normalizer == LossNormalizer(tokens=2 * 2 + 3 * 2, sequences=2 + 3)  # + the uniform group's


def test_trajectories_that_sampled_nothing_make_no_datum_but_keep_their_advantage_slot():
    empty = Trajectory(task=Task("t", "e"), reward=0.0, error=ErrorRecord("rollout_failed", "x"))
    empty.append([1, 2, 3], sampled=False)
    g = TrajectoryGroup(Task("t", "e"), [traj(1.0), empty], max_failing=1)
    p = prepare(select_groups([g], drop_uniform=True), "mean")
    assert p.advantages == [0.5, -0.5] and len(p.datums) == 1
    assert loss_normalizer(p.datums, []) == LossNormalizer(2.0, 1.0)


def test_zscore_of_a_uniform_group_is_zero_not_nan():
    p = prepare(select_groups([group(3.0, 3.0)], drop_uniform=False), "zscore")
    assert p.advantages == [0.0, 0.0] and not any(math.isnan(a) for a in p.advantages)


def test_check_batch_fails_a_step_whose_rollouts_all_failed():
    """A batch with nothing to train on (every episode, or every game of every policy, errored; or no
    rollout came back) stops the job; one good rollout anywhere is enough to go on."""
    from otray.actors.job.step import Batch, check_batch
    from otray.types import RolloutError, WorkersLostError

    def batch(groups):
        return Batch(groups, "d", 0.0, 0.0, 0.0, 0)

    dead = TrajectoryGroup(Task("t", "e"), [traj(0.0, error=True), traj(0.0, error=True)], failed=[traj(0.0, error=True)])
    for broken in ({"main": [dead, dead]}, {"main": [dead], "other": [dead]}, {"main": []}, {}):
        with pytest.raises(RolloutError, match="step 4: all .*rollouts failed"):
            check_batch(batch(broken), 4)
    check_batch(batch({"main": [dead], "other": [group(1.0, 0.0)]}), 4)  # a game whose other seat played
    lost = traj(0.0)  # every rollout lost to dead workers: a death a restart heals, not a failing env
    lost.error = ErrorRecord("rollout_failed", "WorkersLostError: every rollout worker failed: worker 0: ActorDiedError")
    with pytest.raises(WorkersLostError, match="step 4: all 2 rollouts failed"):
        check_batch(batch({"main": [TrajectoryGroup(Task("t", "e"), [lost, lost])]}), 4)
    with pytest.raises(RolloutError) as mixed:  # one env failure among them: not a death
        check_batch(batch({"main": [TrajectoryGroup(Task("t", "e"), [lost, traj(0.0, error=True)])]}), 4)
    assert not isinstance(mixed.value, WorkersLostError)
