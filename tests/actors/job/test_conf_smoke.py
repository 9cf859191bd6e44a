"""Smoke runs: every config in conf/ trains for a couple of steps on the tiny model."""

import pytest

from otray import config

from tests.conftest import ROOT  # noqa: E402 (the repository root)
from tests.fixtures.jobs import check_smoke_run
# per config: overrides that shrink it to a couple of steps (every file in conf/ needs an entry)
# game entries train on uniform groups too: two small steps may otherwise hold none with a gradient,
# and the test checks that every trained policy's learner ran (games drop uniform groups like envs)
SMOKE = {
    "arithmetic_grpo.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=4",
                             "eval.num_samples=5"],
    "arithmetic_sft.yaml": ["sft.steps=2", "sft.eval_samples=8", "eval.num_samples=5", "checkpoint.save_every=1"],
    "guess_number.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=2",
                          "eval.num_samples=4"],
    "bandit.yaml": ["algo.steps=2", "algo.batch_size=2", "eval.num_samples=4"],
    "mcp_calculator.yaml": ["algo.steps=2", "algo.batch_size=2", "eval.num_samples=4"],
    "verifiers_reverse.yaml": ["algo.steps=2", "algo.batch_size=2", "eval.num_samples=4"],
    "math_word.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=2",
                       "eval.num_samples=4"],
    "calculator.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "sft.batch_size=4", "algo.steps=2",
                        "algo.batch_size=2", "eval.num_samples=4", "sft.dataset.kwargs.num_train=8",
                        "sft.dataset.kwargs.num_eval=2"],
    "math_code.yaml": ["algo.steps=2", "algo.batch_size=2", "eval.num_samples=2"],
    "multienv.yaml": ["algo.steps=2", "algo.batch_size=6", "eval.num_samples=3"],
    "openreward.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "sft.batch_size=4", "algo.steps=2",
                        "algo.batch_size=2", "eval.num_samples=4"],
    "openreward_mixed.yaml": ["algo.steps=2", "algo.batch_size=6", "eval.num_samples=3"],
    "textarena_tictactoe.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=3",
                                 "sft.steps=2", "sft.batch_size=4", "algo.drop_uniform_groups=false",
                                 "sft.dataset.kwargs.num_train=40", "sft.dataset.kwargs.num_eval=8"],
    "gomoku_opentinker.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2",
                               "sft.steps=2", "sft.batch_size=4", "algo.drop_uniform_groups=false",
                               "sft.dataset.kwargs.num_train=40", "sft.dataset.kwargs.num_eval=8"],
    "gomoku_selfplay.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2",
                            "algo.drop_uniform_groups=false"],
    "textworld.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "sft.batch_size=4", "algo.steps=2",
                       "algo.batch_size=2", "eval.num_samples=2", "envs.treasure.num_rollouts=2",
                       *(f"{s}.dataset.kwargs.{k}={n}" for s in ("sft", "envs.treasure") for k, n in
                         (("num_train", 3), ("num_eval", 2)))],
    "alfworld.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "sft.batch_size=4", "algo.steps=2",
                      "algo.batch_size=2", "eval.num_samples=2", "envs.alfworld.num_rollouts=2",
                      *(f"{s}.dataset.kwargs.{k}={n}" for s in ("sft", "envs.alfworld") for k, n in
                        (("num_train", 3), ("num_eval", 2)))],
    "count_shapes.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=2",
                          "eval.num_samples=4"],
    "shape_quiz.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=2",
                        "eval.num_samples=4", *(f"envs.shape_quiz.{k}.question=where" for k in ("kwargs", "dataset.kwargs"))],
    "shapes_times.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "sft.batch_size=4", "algo.steps=2",
                          "algo.batch_size=2", "eval.num_samples=2", "sft.dataset.kwargs.num_train=8",
                          "sft.dataset.kwargs.num_eval=2"],
    "rps_vs_scripted.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2",
                            "algo.drop_uniform_groups=false"],
}


# configs whose smoke run is a heavier test's own job (the same checks, :func:`check_smoke_run`, on that run):
# a second job of the same config here cost ~20-35 s of a CPU-bound suite
RUN_ELSEWHERE = {"tictactoe_vs_random.yaml": "tests/actors/job/test_league.py (league_job)",
                 "gomoku_two_policies.yaml": "tests/actors/job/test_league.py::test_two_trained_policies_each_meet_the_others_pool"}


def test_every_config_has_a_smoke_entry():
    assert sorted(p.name for p in (ROOT / "conf").glob("*.yaml")) == sorted([*SMOKE, *RUN_ELSEWHERE])
    assert not set(SMOKE) & set(RUN_ELSEWHERE)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_config_runs_two_steps(ray_local, tmp_path, name):
    from otray.actors.job.run import run

    # (a held-out SFT loss over 8 chat rows, not 200: the learner's forward of them was the larger part of a
    # tic-tac-toe smoke job's learner time)
    cfg = config.load(ROOT / "conf" / name, SMOKE[name] + ["sft.eval_samples=8", f"job.output_dir={tmp_path}"])
    job_dir = tmp_path / cfg.job.name
    check_smoke_run(cfg, job_dir, run(cfg, job_dir), steps=2)


def test_gpu_configs_load():
    """conf/gpu/ (one GPU: colocated, split 0.5/0.5, the 0.5B-shape throughput run, a real hub model,
    ALFWorld as OpenTinker trains it, geometry figures on a hub VLM, Gomoku with tiny-4m) load and ask for
    a GPU; they run on a GPU machine (NOTES.md, `make gpu-check`; ALFWorld's also needs its download)."""
    found = sorted((ROOT / "conf" / "gpu").glob("*.yaml"))
    assert len(found) == 7
    for path in found:
        cfg = config.load(path)
        assert cfg.resources.learner_gpus > 0 and cfg.model.dtype == "auto", path.name
        assert cfg.rollout.colocate or cfg.resources.rollout_gpus > 0, path.name
