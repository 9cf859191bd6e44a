"""RL's learning-rate schedule (otray/algos/schedule.py)."""

import pytest

from otray.algos.schedule import COSINE_FLOOR, learning_rate
from otray.config import AlgoSection


def _rates(schedule, warm=0, steps=10):
    algo = AlgoSection(learning_rate=1.0, steps=steps, lr_schedule=schedule, lr_warmup_steps=warm)
    return [learning_rate(algo, s) for s in range(1, steps + 1)]


def test_constant_is_the_configured_rate_at_every_step():
    assert _rates("constant") == [1.0] * 10


def test_warm_up_rises_linearly_then_the_schedule_starts_at_the_full_rate():
    for schedule in ("constant", "linear", "cosine"):
        got = _rates(schedule, warm=4)
        assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and got[4] == pytest.approx(1.0), schedule


def test_linear_and_cosine_fall_to_their_ends_and_never_stop_learning():
    linear, cosine = _rates("linear"), _rates("cosine")
    assert linear == pytest.approx([1.0 - i / 10 for i in range(10)])
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(COSINE_FLOOR)
    for rates in (linear, cosine):
        assert all(a >= b > 0 for a, b in zip(rates, rates[1:]))
