"""Game jobs through the one RL step (otray.actors.job.step.rl_step): one-step-off-policy and colocated
tic-tac-toe, and the same group dropping and group counts as env jobs."""

import json

import pytest

from otray import config

from tests.conftest import ROOT  # noqa: E402 (the repository root)
SMALL = ["algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2", "sft.steps=0", "eval.every=0",
         "checkpoint.save_at_end=false", "sft.eval_samples=8"]
GROUP_KEYS = {"groups_kept", "groups_dropped_uniform", "groups_dropped_failing"}


@pytest.fixture(scope="module")
def run_game(ray_local, tmp_path_factory):
    from otray.actors.job.run import run

    def _run(name: str, overrides: list[str]) -> list[dict]:
        out = tmp_path_factory.mktemp(name)
        cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml", SMALL + overrides + [f"job.output_dir={out}"])
        run(cfg, out / name)
        return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]

    return _run


def test_one_step_off_policy_game_trains_each_batch_one_version_late(run_game):
    # every group trained on, so every step updates the policy and the lag shows
    overrides = ["algo.steps=3", "algo.max_steps_off_policy=1", "algo.drop_uniform_groups=false"]
    rows = [r for r in run_game("offpolicy", overrides) if r["phase"] == "grpo"]
    assert len(rows) == 3 and [r["policy_lag"] for r in rows] == [0, 1, 1]
    assert len({r["batch"] for r in rows}) == 3  # three different seed ranges
    assert all("time/rollout_wait_s" in r for r in rows[1:])  # later batches were played while it trained
    assert all(r["games"] == 2 * 2 * 2 and r["games_errored"] == 0 for r in rows)  # seeds x seatings x rollouts
    assert all(GROUP_KEYS <= set(r) for r in rows) and "eval/accuracy" in rows[-1]
    assert [r["learner/step"] for r in rows] == [1, 2, 3]


def test_colocated_game_samples_from_the_learner(run_game):
    from otray.actors.control.resource_manager import bundles_for

    overrides = ["algo.steps=3", "rollout.colocate=true", "algo.drop_uniform_groups=false"]
    assert len(bundles_for(config.load(ROOT / "conf" / "tictactoe_vs_random.yaml", SMALL + overrides))) == 1
    rows = [r for r in run_game("colocated", overrides) if r["phase"] == "grpo"]
    assert len(rows) == 3 and [r["policy_lag"] for r in rows] == [0, 0, 0]
    assert all(r["time/weight_sync_s"] < 0.05 and r["time/generate_s"] > 0 for r in rows)  # nothing to send
    assert [r["learner/step"] for r in rows] == [1, 2, 3] and "eval/accuracy" in rows[-1]


def test_game_step_drops_uniform_groups_and_counts_them_like_an_env_step(run_game):
    """One game per (seed, seating): every group holds one trajectory, so every group is uniform. With
    drop_uniform_groups (the default) all are dropped and the learner is not called; without it all
    are trained on. Either way the row carries the env step's group counts, and they add up."""
    groups = 2 * 2  # batch_size seeds x 2 seatings (rotate_seats), one trained role each
    dropped = run_game("dropped", ["algo.steps=1", "game.num_rollouts=1"])[-1]
    assert GROUP_KEYS <= set(dropped)
    assert (dropped["groups_kept"], dropped["groups_dropped_uniform"], dropped["groups_dropped_failing"]) == (0, groups, 0)
    assert not any(k.startswith("learner/") for k in dropped)  # no datum: no forward_backward, no optimizer step
    kept = run_game("kept", ["algo.steps=1", "game.num_rollouts=1", "algo.drop_uniform_groups=false"])[-1]
    assert (kept["groups_kept"], kept["groups_dropped_uniform"]) == (groups, groups)
    assert kept["learner/step"] == 1 and kept["learner/num_sequences"] == groups
