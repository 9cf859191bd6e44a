import statistics

import pytest

from otray.algos import advantages as adv
from otray.algos.datums import build_datums, sft_datum, trajectory_to_datum
from otray.types import ConfigError, Task, Trajectory


def test_group_estimators():
    r = [1.0, 0.0, 0.0, 1.0]
    assert adv.group_mean(r) == [0.5, -0.5, -0.5, 0.5]
    z = adv.group_zscore(r)
    assert statistics.fmean(z) == pytest.approx(0.0)
    assert z[0] == pytest.approx(1.0, rel=1e-4)
    # RLOO: r_i minus the mean of the others
    assert adv.rloo([1.0, 0.0, 0.0]) == pytest.approx([1.0, -0.5, -0.5])
    assert adv.compute("zscore", [3.0, 3.0]) == [0.0, 0.0]


def test_grouped_by_key_and_unknown_name():
    out = adv.grouped("mean", [1.0, 0.0, 5.0, 7.0], [("s1", "p0"), ("s1", "p0"), ("s1", "p1"), ("s1", "p1")])
    assert out == [0.5, -0.5, -1.0, 1.0]
    with pytest.raises(ConfigError):
        adv.compute("gae", [1.0])


def _traj():
    t = Trajectory(task=Task("a", "e"))
    t.append([10, 11, 12], sampled=False)
    t.append([13, 14], sampled=True, logprobs=[-0.1, -0.2])
    t.append([15], sampled=False)
    t.append([16], sampled=True, logprobs=[-0.3])
    return t


def test_datum_is_shifted_and_aligned_to_targets():
    d = trajectory_to_datum(_traj(), 2.0)
    assert d.input_ids == [10, 11, 12, 13, 14, 15]
    assert d.target_ids == [11, 12, 13, 14, 15, 16]
    assert d.mask == [0, 0, 1, 1, 0, 1]
    assert d.sampler_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert d.advantages == [0, 0, 2.0, 2.0, 0, 2.0]


def test_build_datums_skips_empty_trajectories():
    empty = Trajectory(task=Task("b", "e"))
    empty.append([1, 2], sampled=False)
    assert len(build_datums([_traj(), empty], [1.0, 1.0])) == 1


def test_sft_datum_masks_prompt():
    d = sft_datum([1, 2, 3], [4, 5])
    assert d.target_ids == [2, 3, 4, 5]
    assert d.mask == [0, 0, 1, 1] and d.weights == [0, 0, 1, 1]
