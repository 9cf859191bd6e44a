"""Does the tiny VLM learn from what it sees? ``python benchmarks/vlm_learning.py [--env E] [--seeds 0 1] [OVERRIDE ...]``.

Trains ``conf/count_shapes.yaml`` (count 1-4 shapes in a 56x56 picture; SFT warm-up on the counts, then
GRPO) on otray's tiny Qwen2-VL once per seed, and once more per seed with the pictures blanked
(``envs.count_shapes.kwargs.blank=true``, the control: the same prompts, a white picture), one run after
another (never beside the test suite: two cores). Saves ``benchmarks/results/vlm_learning.json``: per run the
held-out accuracy (greedy, on pictures never trained on) of the base model, after the SFT warm-up and at the
end, the wall time and every eval row. The issue's bar (``passed``): with pictures, the end accuracy is at
least 15 points above the base model's in every seed, in under 15 minutes a run; blanked, it stays within 5
points of chance (25%: a count of 1-4 drawn uniformly), so the gain comes from seeing.

``--env shapes_times``: the multi-turn, tool-using env (``conf/shapes_times.yaml``: multiply the picture's count
by a two-digit number with the calculator), no control run; saves ``vlm_tool_learning.json``. Its bar: the
held-out success rate and the tool calls per episode both rise from the base model's, in every seed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from collect_runs import collect  # noqa: E402
from results_io import save  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CHANCE = 0.25
KEY = "eval/count_shapes/accuracy"
TOOL_KEYS = ("eval/shapes_times/success_rate", "eval/shapes_times/tool_calls_mean")


def run(seed: int, blank: bool, overrides: list[str], runs: Path, env: str = "count_shapes") -> dict:
    out = runs / f"{env}_{'blank' if blank else 'seen'}_s{seed}"
    start = time.monotonic()
    cmd = [str(ROOT / ".venv" / "bin" / "otray"), "train", str(ROOT / "conf" / f"{env}.yaml"),
           f"job.seed={seed}", f"job.output_dir={out}", f"envs.{env}.kwargs.blank={str(blank).lower()}",
           *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.monotonic() - start
    job_dir = max(out.iterdir(), key=lambda p: p.stat().st_mtime)
    rows = collect(job_dir)["eval_rows"]
    base = next(r for r in rows if r["phase"] == "base")
    sft = next((r for r in rows if r["phase"] == "sft"), None)
    end = rows[-1]
    if env != "count_shapes":
        at = lambda row: {k.rsplit("/", 1)[1]: row.get(k) for k in TOOL_KEYS} if row else None  # noqa: E731
        return {"seed": seed, "wall_s": wall, "base": at(base), "after_sft": at(sft), "end": at(end),
                "end_step": end.get("step"), "eval_rows": rows}
    return {"seed": seed, "blank": blank, "wall_s": wall, "base": base.get(KEY),
            "after_sft": sft.get(KEY) if sft else None, "end": end.get(KEY), "end_step": end.get("step"),
            "gain_points": 100 * (end.get(KEY, 0.0) - base.get(KEY, 0.0)), "eval_rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=("count_shapes", "shapes_times"), default="count_shapes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_vlm")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every run")
    args = parser.parse_args()
    if args.env == "shapes_times":
        return tool_main(args)
    results = [run(s, blank, args.overrides, args.runs) for s in args.seeds for blank in (False, True)]
    seen = [r for r in results if not r["blank"]]
    blank = [r for r in results if r["blank"]]
    summary = {"config": "conf/count_shapes.yaml", "overrides": args.overrides, "chance": CHANCE,
               "passed": all(r["gain_points"] >= 15 and r["wall_s"] < 900 for r in seen)
               and all(abs(r["end"] - CHANCE) <= 0.05 for r in blank), "runs": results}
    for r in results:
        sft = "n/a" if r["after_sft"] is None else f"{r['after_sft']:.3f}"
        print(f"seed {r['seed']} {'blanked' if r['blank'] else 'pictures'}: held-out accuracy {r['base']:.3f} (base) "
              f"-> {sft} (after SFT) -> {r['end']:.3f} (step {r['end_step']}); {r['wall_s']:.0f} s")
    print(f"passed (pictures: >= +15 points in < 15 min; blanked: within 5 points of {CHANCE:.0%}): {summary['passed']}")
    save(summary, RESULTS / "vlm_learning.json")


def tool_main(args: argparse.Namespace) -> None:
    results = [run(s, False, args.overrides, args.runs, "shapes_times") for s in args.seeds]
    rises = lambda r, k: r["end"][k] > r["base"][k]  # noqa: E731
    summary = {"config": "conf/shapes_times.yaml", "overrides": args.overrides,
               "passed": all(rises(r, "success_rate") and rises(r, "tool_calls_mean") for r in results),
               "runs": results}
    for r in results:
        show = lambda row: "n/a" if row is None else (  # noqa: E731
            f"success {row['success_rate']:.3f}, tool calls/episode {row['tool_calls_mean']:.2f}")
        print(f"seed {r['seed']}: {show(r['base'])} (base) -> {show(r['after_sft'])} (after SFT) -> {show(r['end'])} "
              f"(step {r['end_step']}); {r['wall_s']:.0f} s")
    print(f"passed (success and tool calls both rise in every seed): {summary['passed']}")
    save(summary, RESULTS / "vlm_tool_learning.json")


if __name__ == "__main__":
    main()
