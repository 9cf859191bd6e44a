"""Does RL hold and add on every bundled recipe? ``python benchmarks/recipes.py [--families F ...] [--seeds 0 1] [OVERRIDE ...]``.

Runs each single-agent config family (``FAMILIES``: the arithmetic demo, math_word, calculator, guess_number,
count_shapes, shapes_times, textworld, openreward, and the four shape_quiz questions no recipe was tuned on)
once per seed, one run after another (never beside the test suite: two cores), with step counts cut to what
still shows learning. Per run it keeps the held-out score RL started from (after the SFT warm-up, or before
any training without one), its standard error, the score at the end and the change, and whether the run
``held`` (ended no more than that standard error below the start) and ``gained`` (at least +5 points).
Saves ``benchmarks/results/recipes.json`` after every run (a run that fails is recorded as failed, and the
rest go on). The issue's bar (issue 55): every run held, and at least three quarters gained.

The figures are the bundled configs' as they are: any ``OVERRIDE`` (key=value) applies to every run, e.g.
``algo.kl_coeff=0.1`` to measure an algorithm setting across all families.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from collect_runs import collect  # noqa: E402
from results_io import save  # noqa: E402

GAIN = 0.05  # the points a run must add to count as "gained"


@dataclass
class Family:
    config: str  # conf/<config>.yaml
    overrides: list[str] = field(default_factory=list)  # the cut step counts, and what picks the task


def quiz(question: str) -> Family:
    return Family("shape_quiz", [f"envs.shape_quiz.kwargs.question={question}",
                                 f"envs.shape_quiz.dataset.kwargs.question={question}"])


FAMILIES = {
    "arithmetic": Family("arithmetic_grpo"),
    "math_word": Family("math_word"),
    "calculator": Family("calculator"),
    "guess_number": Family("guess_number"),
    "count_shapes": Family("count_shapes"),
    "shapes_times": Family("shapes_times"),
    "textworld": Family("textworld"),
    "openreward": Family("openreward"),
    "shape_quiz_colour": quiz("colour"),
    "shape_quiz_kind": quiz("kind"),
    "shape_quiz_where": quiz("where"),
    "shape_quiz_size": quiz("size"),
}


def run(name: str, family: Family, seed: int, overrides: list[str], runs: Path) -> dict:
    """One run of one family at one seed: its start, end and verdict (or the failure)."""
    out = runs / f"{name}_s{seed}"
    cmd = [str(ROOT / ".venv" / "bin" / "otray"), "train", str(ROOT / "conf" / f"{family.config}.yaml"),
           f"job.seed={seed}", f"job.output_dir={out}", *family.overrides, *overrides]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT)
    wall = time.monotonic() - start
    base = {"family": name, "seed": seed, "wall_s": wall, "command": " ".join(cmd[1:])}
    if done.returncode != 0 or not out.exists():
        return {**base, "failed": f"otray train exited {done.returncode}"}
    run_dir = max(out.iterdir(), key=lambda p: p.stat().st_mtime)
    rows = collect(run_dir)["eval_rows"]
    first = next((r for r in rows if r["phase"] in ("sft", "init")), None)
    end = rows[-1] if rows else None
    if first is None or end is None or "eval/accuracy" not in first or end is first:
        return {**base, "failed": "no held-out accuracy before and after RL", "eval_rows": rows}
    a0, a1 = first["eval/accuracy"], end["eval/accuracy"]
    se = first.get("eval/accuracy_stderr", 0.0)
    return {**base, "start": a0, "stderr": se, "end": a1, "change_points": 100 * (a1 - a0),
            "held": a1 >= a0 - se, "gained": a1 - a0 >= GAIN - 1e-9, "end_step": end["step"],
            **clipped(run_dir), "eval_rows": rows}


def clipped(run_dir: Path) -> dict:
    """How many RL steps of the run in ``run_dir`` a gradient bound cut (their norm before clipping above it), and
    which of those the relative bound (``algo.grad_clip_relative``) set, lower than ``algo.grad_clip``."""
    fixed = json.loads((run_dir / "config.json").read_text())["algo"]["grad_clip"]
    rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if "learner/grad_clip" in r]
    cut = [r for r in rl if r["learner/grad_clip"] and r["learner/grad_norm"] > r["learner/grad_clip"]]
    relative = [r["step"] for r in cut if not fixed or r["learner/grad_clip"] < fixed]
    return {"rl_steps_clipped": len(cut), "rl_steps_clipped_relative": len(relative), "rl_steps_clipped_at": relative}


def kept(out: Path, overrides: list[str]) -> list[dict]:
    """The runs saved in ``out`` by an earlier invocation, which must have used the same overrides."""
    if not out.exists():
        return []
    earlier = json.loads(out.read_text())
    if earlier.get("overrides", []) != overrides:
        raise SystemExit(f"--update: {out} holds runs made with overrides {earlier.get('overrides')}, not "
                         f"{overrides}: use another --out, or the same overrides")
    return list(earlier["results"])


def verdict(results: list[dict]) -> dict:
    ran = [r for r in results if "failed" not in r]
    gained = sum(r["gained"] for r in ran)
    return {"runs": len(results), "failed": len(results) - len(ran), "held": sum(r["held"] for r in ran),
            "gained": gained, "passed": bool(ran) and len(ran) == len(results) and all(r["held"] for r in ran)
            and gained >= 0.75 * len(ran)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_recipes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recipes.json")
    parser.add_argument("--update", action="store_true",
                        help="keep the runs already in --out (made with the same overrides) and replace or add "
                             "only the families and seeds run now")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every run")
    args = parser.parse_args()
    results = kept(args.out, args.overrides) if args.update else []
    for name in args.families:
        for seed in args.seeds:
            r = run(name, FAMILIES[name], seed, args.overrides, args.runs)
            results = [x for x in results if (x["family"], x["seed"]) != (name, seed)] + [r]
            line = (r["failed"] if "failed" in r else
                    f"{r['start']:.3f} -> {r['end']:.3f} ({r['change_points']:+.1f} points, stderr "
                    f"{100 * r['stderr']:.1f}): {'held' if r['held'] else 'LOST'}, "
                    f"{'gained' if r['gained'] else 'no gain'}, {r['rl_steps_clipped_relative']} RL steps cut by "
                    f"the relative bound")
            print(f"{name} seed {seed}: {line}; {r['wall_s']:.0f} s", flush=True)
            save({"overrides": args.overrides, **verdict(results), "results": results}, args.out)
    v = verdict(results)
    print(f"{v['held']}/{v['runs'] - v['failed']} held, {v['gained']} gained >= {100 * GAIN:.0f} points, "
          f"{v['failed']} failed: passed {v['passed']}")


if __name__ == "__main__":
    main()
