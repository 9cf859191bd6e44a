"""Smoke runs: every config in conf/ trains for a couple of steps on the tiny model."""

import json
from pathlib import Path

import pytest

from otray import config
from otray.policies import PolicySpec

from tests.conftest import ROOT  # noqa: E402 (the repository root)
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
    "tictactoe_vs_random.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=3",
                                 "sft.steps=2", "sft.batch_size=4", "algo.drop_uniform_groups=false"],
    "textarena_tictactoe.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=3",
                                 "sft.steps=2", "sft.batch_size=4", "algo.drop_uniform_groups=false",
                                 "sft.dataset.kwargs.num_train=40", "sft.dataset.kwargs.num_eval=8"],
    "gomoku_opentinker.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2",
                               "sft.steps=2", "sft.batch_size=4", "algo.drop_uniform_groups=false",
                               "sft.dataset.kwargs.num_train=40", "sft.dataset.kwargs.num_eval=8"],
    "gomoku_selfplay.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2",
                            "algo.drop_uniform_groups=false"],
    "gomoku_two_policies.yaml": ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2",
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


def test_every_config_has_a_smoke_entry():
    assert sorted(p.name for p in (ROOT / "conf").glob("*.yaml")) == sorted(SMOKE)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_config_runs_two_steps(ray_local, tmp_path, name):
    from otray.actors.job.run import run

    cfg = config.load(ROOT / "conf" / name, SMOKE[name] + [f"job.output_dir={tmp_path}"])
    job_dir = tmp_path / cfg.job.name
    summary = run(cfg, job_dir)
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and summary["heldout_end"] is not None
    if cfg.game is not None:  # win/draw/loss per trained policy, role and eval opponent
        g, last = cfg.game, rows[-1]
        trained = config.trained_policies(cfg)
        for name in trained:
            prefix = "eval/" if len(trained) == 1 else f"eval/{name}/"
            for role in g.policies:
                for opponent in (PolicySpec.parse(o).label for o in g.eval_opponents):
                    rates = [last[f"{prefix}{role}_vs_{opponent}/{k}_rate"] for k in ("win", "loss", "draw", "timeout")]
                    assert sum(rates) + last[f"{prefix}{role}_vs_{opponent}/error_rate"] == pytest.approx(1.0)
            loss = "learner/loss" if len(trained) == 1 else f"policy/{name}/learner/loss"
            assert loss in last, sorted(last)
        assert last["elo/random"] == 1000.0 and all(f"elo/{n}" in last for n in trained), sorted(last)
        seatings = len(g.seatings) or (len(g.policies) if g.rotate_seats else 1)
        assert last["games"] == 2 * 2 * seatings and last["games_errored"] == 0
    if len(cfg.envs) > 1:  # every metric per env and overall
        for env in cfg.envs:
            assert f"eval/{env}/reward_mean" in rows[-1] and f"eval/{env}/turns_mean" in rows[-1]
        assert any(k.startswith("env/") and k.endswith("/reward_mean") for k in rows[-1])
        for env in cfg.envs:  # tool envs: tool calls and their error rate
            if env in ("calculator", "tool_addition"):  # (mcp_calculator's env is also named calculator)
                assert f"eval/{env}/tool_error_rate" in rows[-1], sorted(rows[-1])


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
