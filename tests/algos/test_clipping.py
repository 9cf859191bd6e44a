"""RL's gradient clip relative to the recent steps' norms (otray/algos/clipping.py)."""

import pytest

from otray.algos.clipping import MIN_SEEN, WINDOW, grad_clip, remember


def test_off_or_too_few_steps_seen_is_the_fixed_bound():
    assert grad_clip([0.1] * 30, 1.0, 0.0) == 1.0
    assert grad_clip([0.1] * (MIN_SEEN - 1), 1.0, 2.0) == 1.0
    assert grad_clip([], 0.0, 2.0) == 0.0  # no fixed bound either: none


def test_the_bound_is_k_times_the_recent_median_when_below_the_fixed_one():
    norms = [0.06, 0.08, 0.10, 0.07, 0.09]
    assert grad_clip(norms, 1.0, 2.0) == pytest.approx(2.0 * 0.08)
    assert grad_clip(norms, 0.1, 2.0) == 0.1  # the fixed bound is lower: it holds
    assert grad_clip(norms, 0.0, 2.0) == pytest.approx(2.0 * 0.08)  # no fixed bound: the relative one alone
    # a spike's own norm moves the median little: the next spike is cut as hard
    assert grad_clip([*norms, 0.45], 1.0, 2.0) == pytest.approx(2.0 * 0.085)


def test_only_the_last_window_of_norms_counts():
    recent: list[float] = []
    for _ in range(WINDOW):
        remember(recent, 1.0)
    for _ in range(WINDOW // 2 + 1):
        remember(recent, 0.1)
    assert len(recent) == WINDOW and grad_clip(recent, 0.0, 1.0) == 0.1
