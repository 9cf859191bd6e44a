"""``benchmarks/shared_cycle.py``'s reading of a shared learner's cycle from the marks its actors note."""

from __future__ import annotations

import pytest

from benchmarks.shared_cycle import timeline


def test_a_cycles_gaps_and_the_compute_threads_idle_share_are_read_from_the_marks():
    """Two 100 ms cycles: in at 0, pass 1-61, optimizer answers 61-64, out 65, answered 67, updated 70, send 95,
    in again at 100. The compute thread is free from 70 (the update's end, after the answer) to the next pass at
    101: 31 of each 100 ms. A mark outside the window is not read."""
    marks, t = [], 0.0
    for _ in range(3):
        for name, at in (("in", 0), ("pass", 1), ("optim", 61), ("out", 65), ("answered", 67), ("updated", 70),
                         ("send", 95)):
            marks.append((name, t + at / 1e3))
        t += 0.1
    got = timeline(marks + [("pass", 9.0)], 0.0, 0.3)
    assert got["cycles"] == 2 and got["cycle_ms"] == pytest.approx(100)
    assert got["gaps_ms"]["pass->optim"] == pytest.approx(60) and got["gaps_ms"]["updated->send"] == pytest.approx(25)
    assert list(got["gaps_ms"])[0] == "pass->optim"  # the biggest part first
    assert got["compute_idle_share"] == pytest.approx(62 / 200)
    # the answer leaving at 75, after the update's end: the thread is free from then
    late = timeline([(n, at + (0.01 if n == "out" else 0.0)) for n, at in marks], 0.0, 0.3)
    assert late["compute_idle_share"] == pytest.approx(52 / 200)
