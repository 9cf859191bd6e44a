"""Does the tiny model learn TextWorld? ``python benchmarks/textworld_learning.py [--seeds 0 1] [OVERRIDE ...]``.

Trains ``conf/textworld.yaml`` (treasure hunter games generated here; SFT warm-up on walkthroughs, then
GRPO) once per seed with ``otray train``, one run after another (never beside the test suite: two cores),
and saves ``benchmarks/results/textworld_learning.json``. ``--config conf/alfworld.yaml`` does the same for
ALFWorld's games (rooms made here, games by ``alfworld-generate``) into ``alfworld_learning.json``.
Per seed: the held-out success rate of the base
model, after the SFT warm-up and at the end (greedy, on games never trained on), the invalid-action rate
and turns at each, the wall time, and every eval row. The issue's bar: the end success rate is at least
15 points above the base model's in both seeds (``passed``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from collect_runs import collect  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
KEYS = ("success_rate", "invalid_action_rate", "turns_mean")


def run_seed(config: Path, seed: int, overrides: list[str], runs: Path) -> dict:
    from otray import config as otray_config

    env = next(iter(otray_config.load(config).envs))

    def at(row: dict) -> dict:
        return {k: row.get(f"eval/{env}/{k}") for k in KEYS}

    out = runs / f"{config.stem}_s{seed}"
    start = time.monotonic()
    cmd = [str(ROOT / ".venv" / "bin" / "otray"), "train", str(config), f"job.seed={seed}", f"job.output_dir={out}",
           *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT)
    job_dir = max(out.iterdir(), key=lambda p: p.stat().st_mtime)
    run = collect(job_dir)
    rows = run["eval_rows"]
    base = next(r for r in rows if r["phase"] == "base")
    sft = next((r for r in rows if r["phase"] == "sft"), None)
    end = rows[-1]
    return {"seed": seed, "wall_s": time.monotonic() - start, "base": at(base), "after_sft": at(sft) if sft else None,
            "end": at(end), "end_step": end.get("step"), "gain_points": 100 * (at(end)["success_rate"] - at(base)["success_rate"]),
            "grpo_gain_points": (100 * (at(end)["success_rate"] - at(sft)["success_rate"]) if sft else None),
            "run": run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--config", type=Path, default=ROOT / "conf" / "textworld.yaml")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_textworld")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every seed")
    args = parser.parse_args()
    config = args.config.resolve()
    results = [run_seed(config, s, args.overrides, args.runs) for s in args.seeds]
    summary = {"config": str(config.relative_to(ROOT)), "overrides": args.overrides,
               "passed": all(r["gain_points"] >= 15 for r in results), "seeds": results}
    out = RESULTS / f"{config.stem}_learning.json"
    out.write_text(json.dumps(summary, indent=1))
    for r in results:
        sft = r["after_sft"]["success_rate"] if r["after_sft"] else float("nan")
        print(f"seed {r['seed']}: held-out success {r['base']['success_rate']:.3f} (base) -> {sft:.3f} (after SFT) -> "
              f"{r['end']['success_rate']:.3f} (step {r['end_step']}); +{r['gain_points']:.1f} points; "
              f"invalid actions/turn {r['end']['invalid_action_rate']:.3f}; {r['wall_s']:.0f} s")
    print(f"passed (>= 15 points in every seed): {summary['passed']}; saved {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
