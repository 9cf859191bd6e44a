"""Smoke runs: every config in conf/ trains for a couple of steps on the tiny model."""

import json
from pathlib import Path

import pytest

from otray import config

ROOT = Path(__file__).resolve().parents[1]
# per config: overrides that shrink it to a couple of steps (every file in conf/ needs an entry)
SMOKE = {
    "arithmetic_grpo.yaml": ["sft.steps=2", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=4",
                             "eval.num_samples=5"],
    "arithmetic_sft.yaml": ["sft.steps=2", "sft.eval_samples=8", "eval.num_samples=5", "checkpoint.save_every=1"],
}


def test_every_config_has_a_smoke_entry():
    assert sorted(p.name for p in (ROOT / "conf").glob("*.yaml")) == sorted(SMOKE)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_config_runs_two_steps(ray_local, tmp_path, name):
    from otray.train import run

    cfg = config.load(ROOT / "conf" / name, SMOKE[name] + [f"job.output_dir={tmp_path}"])
    job_dir = tmp_path / cfg.job.name
    summary = run(cfg, job_dir)
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and summary["heldout_end"] is not None
