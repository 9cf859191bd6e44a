"""The Elo table against hand-computed figures (otray/algos/ratings.py)."""

import pytest

from otray.algos.ratings import EloTable, expected_score, game_score


def test_two_games_by_hand():
    # a and b both 1000, k=32: a wins, E_a = 0.5 -> a 1016, b 984. Then b beats a:
    # E_a = 1 / (1 + 10 ** ((984 - 1016) / 400)) = 1 / (1 + 10 ** -0.08) = 1 / 1.831764 = 0.545922
    # a = 1016 - 32 * 0.545922 = 998.5305, b = 984 + 17.4695 = 1001.4695
    t = EloTable(k=32, anchor=None)
    t.record("a", "b", 1.0)
    assert t.ratings == {"a": 1016.0, "b": 984.0}
    assert expected_score(1016, 984) == pytest.approx(0.545922, abs=1e-6)
    t.record("a", "b", 0.0)
    assert t.rating("a") == pytest.approx(998.5305, abs=1e-3) and t.rating("b") == pytest.approx(1001.4695, abs=1e-3)
    assert t.games == {"a": 2, "b": 2}
    assert sum(t.ratings.values()) == pytest.approx(2000)  # without an anchor, points move between players


def test_the_anchor_never_moves():
    # k=16, trained beats random: 1008, random pinned at 1000. A draw: E = 1 / (1 + 10 ** (-8 / 400))
    # = 1 / 1.954993 = 0.511514 -> 1008 + 16 * (0.5 - 0.511514) = 1007.8158
    t = EloTable(k=16)
    t.record("main", "random", 1.0)
    assert t.ratings == {"main": 1008.0, "random": 1000.0}
    t.record("random", "main", 0.5)  # either seat order
    assert t.rating("main") == pytest.approx(1007.8158, abs=1e-3) and t.rating("random") == 1000.0


def test_a_stronger_player_rises_and_state_round_trips():
    t = EloTable(k=16)
    t.record_all("main", "random", [1.0] * 30 + [0.0] * 10)  # 75% against random
    assert 1050 < t.rating("main") < 1300
    t.record_all("main", "heuristic", [0.0] * 20)  # and never a win against the heuristic
    assert t.rating("heuristic") > t.rating("main") + 100
    back = EloTable.from_state(t.state())
    assert back == t and back.metrics() == t.metrics()
    assert set(t.metrics()) == {"elo/main", "elo/random", "elo/heuristic"}


@pytest.mark.parametrize("reward, score", [(1.0, 1.0), (0.3, 1.0), (0.0, 0.5), (-1.0, 0.0)])
def test_game_score(reward, score):
    assert game_score(reward) == score


def test_bad_games_are_refused():
    t = EloTable()
    with pytest.raises(ValueError, match="against itself"):
        t.record("a", "a", 1.0)
    with pytest.raises(ValueError, match="score is 1"):
        t.record("a", "b", 2.0)
    with pytest.raises(ValueError, match="positive"):
        EloTable(k=0)
