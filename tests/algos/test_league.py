"""The league pool (otray/algos/league.py) and the league's seatings (otray/actors/job/league.py), without Ray."""

import random
from collections import Counter

import pytest

from otray.actors.job.league import LEAGUE, League
from otray.algos.league import LeaguePool
from otray.algos.ratings import EloTable
from otray.config import LeagueSection
from otray.policies import PolicySpec


def test_pool_keeps_the_newest_and_weighs_by_the_policys_score():
    pool = LeaguePool(max_size=3)
    assert pool.sample(random.Random(0)) is None  # empty: no snapshot to draw
    for step in (10, 20, 30, 40):
        pool.add(step, f"/ckpt/step-{step}/model")
    assert [s.step for s in pool.snapshots] == [20, 30, 40]
    pool.add(30, "/elsewhere")  # the same step again keeps its record
    assert [s.model_dir for s in pool.snapshots][1] == "/ckpt/step-30/model"
    # the policy beat step-20 9 times in 10, drew step-30 every game, lost to step-40 4 times in 4
    pool.record(20, [1.0] * 9 + [0.0])
    pool.record(30, [0.5] * 10)
    pool.record(40, [0.0] * 4)
    # smoothed scores (score + 1) / (games + 2): 10/12, 6/12, 1/6 -> weights (1 - p)^2
    assert pool.weights() == pytest.approx([(2 / 12) ** 2, (6 / 12) ** 2, (5 / 6) ** 2])
    drawn = Counter(pool.sample(random.Random(i)).step for i in range(3000))
    assert drawn[40] > drawn[30] > drawn[20] > 0  # hardest first, the beaten one still met
    share = drawn[40] / 3000
    assert share == pytest.approx((5 / 6) ** 2 / sum(pool.weights()), abs=0.03)
    uniform = LeaguePool(3, "uniform", pool.snapshots)
    assert uniform.weights() == [1.0, 1.0, 1.0]
    assert LeaguePool.from_state(pool.state()) == pool


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        LeaguePool(max_size=0)
    with pytest.raises(ValueError, match="priority"):
        LeaguePool(priority="easy")


def _league(trained, **section):
    return League(LeagueSection(every=5, **section), trained, {n: () for n in trained}, job_seed=0)


def test_self_play_league_seatings_keep_each_seat_once():
    league = _league(["main"], fixed=["random"], fixed_share=0.0)
    base = {"black": PolicySpec("trained", "main"), "white": PolicySpec("trained", "main")}
    # empty pool and fixed_share 0: the fixed opponents stand in until the first snapshot
    assert league.seatings(base, seed=1, step=1) == [{"black": "trained:main", "white": "random"},
                                                     {"black": "random", "white": "trained:main"}]
    elo = EloTable()
    league.add(5, "/runs/j/checkpoints/step-000005", elo)
    assert league.pools["main"].snapshots[0].model_dir == "/runs/j/checkpoints/step-000005/model"
    assert elo.rating("main-step-5") == elo.rating("main")
    league.drawn["main"] = league.pools["main"].snapshots[0]  # what draw() picks (it also loads weights)
    assert league.seatings(base, 1, 6) == [{"black": "trained:main", "white": LEAGUE + "main"},
                                           {"black": LEAGUE + "main", "white": "trained:main"}]
    # no fixed opponents and an empty pool: plain self-play
    bare = _league(["main"])
    assert bare.seatings(base, 1, 1) == [{"black": "trained:main", "white": "trained:main"}] * 2


def test_two_policies_meet_each_others_pools_and_fixed_opponents_mix_in():
    league = _league(["b", "w"], fixed=["random", "scripted:envs.gomoku:heuristic"], fixed_share=0.5)
    base = {"black": PolicySpec("trained", "b"), "white": PolicySpec("trained", "w")}
    elo = EloTable()
    league.add(5, "/ck/step-000005", elo)
    assert league.pools["w"].snapshots[0].model_dir == "/ck/step-000005/policies/w/model"
    league.drawn = {n: league.pools[n].snapshots[0] for n in ("b", "w")}
    opponents = Counter()
    for seed in range(400):
        as_black, as_white = league.seatings(base, seed, 6)
        assert as_black["black"] == "trained:b" and as_white["white"] == "trained:w"
        opponents[as_black["white"]] += 1
        opponents[as_white["black"]] += 1
    assert set(opponents) == {LEAGUE + "w", LEAGUE + "b", "random", "scripted:envs.gomoku:heuristic"}
    fixed = opponents["random"] + opponents["scripted:envs.gomoku:heuristic"]
    assert fixed / 800 == pytest.approx(0.5, abs=0.06)
    assert league.seatings(base, 7, 6) == league.seatings(base, 7, 6)  # drawn per (step, seed): replayable
