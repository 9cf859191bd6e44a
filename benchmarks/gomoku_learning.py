"""OpenTinker's Gomoku experiment on the tiny model: ``python benchmarks/gomoku_learning.py [--seeds 0 1] [OVERRIDE ...]``.

Trains ``conf/gomoku_opentinker.yaml`` (or ``--config``: ``conf/gpu/gomoku_4m.yaml`` on a GPU; 4x4, three in a row; the policy in both seats against the
longest-line heuristic with 60% random moves, evaluated against OpenTinker's 30%) once per seed with ``otray train``, one
run after another (never beside the test suite: two cores). Saves
``benchmarks/results/gomoku_learning.json`` (per seed and seat: OpenTinker's four rates and illegal
moves per game against that opponent at every eval, the Elo table, wall time) and
``benchmarks/results/gomoku_learning.png`` (win rate per seat over steps, and Elo).

The issue's bar (``passed``): in both seeds the win rate against the opponent rises by at least 15
points in both seats, from the start of RL to the end. The start of RL is the end of the SFT warm-up: since
session 30 a tactics SFT (positions with one winning or blocking cell, labelled by the rules, not by the
opponent); before it a format-only SFT (random legal moves). ``gain_from_base_points`` also counts the
warm-up (from the untrained model's eval row, where the run has one).
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
from results_io import save_plot  # noqa: E402

CONFIG = "conf/gomoku_opentinker.yaml"
OUT = ROOT / "benchmarks" / "results" / "gomoku_learning.json"
OPPONENT = "heuristic-random_prob-0.3"  # the eval label of scripted:envs.gomoku:heuristic(random_prob=0.3)
SEATS = ("black", "white")
RATES = ("win_rate", "loss_rate", "draw_rate", "timeout_rate", "illegal_per_game")


def seat_rates(row: dict, seat: str, opponent: str = OPPONENT) -> dict:
    return {k: row.get(f"eval/{seat}_vs_{opponent}/{k}") for k in RATES}


def run_seed(seed: int, overrides: list[str], runs: Path, config: str = CONFIG, local: bool = False) -> dict:
    """One seed's run with ``otray train`` (through the ResourceManager), or ``local``: ``python -m otray.train``
    (the job on a local Ray without the manager; what ``make gpu-gomoku`` uses, see its comment)."""
    out = runs / f"gomoku_s{seed}"
    start = time.monotonic()  # this interpreter's otray (a GPU machine has no .venv)
    entry = ["otray.train"] if local else ["otray.cli", "train"]
    cmd = [sys.executable, "-m", *entry, str(ROOT / config), f"job.seed={seed}", f"job.output_dir={out}", *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return summarize(seed, max(out.iterdir(), key=lambda p: p.stat().st_mtime), time.monotonic() - start)


def summarize(seed: int, job_dir: Path, wall_s: float | None) -> dict:
    """One run's figures from its job directory (also for a run stopped early: ``--collect``)."""
    run = collect(job_dir)
    rows = run["eval_rows"]
    start_row = next((r for r in rows if r["phase"] == "sft"), rows[0])  # RL starts here
    end = rows[-1]
    curve = [{"step": r["step"], "phase": r["phase"], **{s: seat_rates(r, s) for s in SEATS},
              "vs_random": {s: seat_rates(r, s, "random")["win_rate"] for s in SEATS},
              "elo": {k[4:]: v for k, v in r.items() if k.startswith("elo/")}} for r in rows]
    gains = {s: 100 * (seat_rates(end, s)["win_rate"] - seat_rates(start_row, s)["win_rate"]) for s in SEATS}
    base = rows[0] if rows[0]["phase"] == "base" else None  # the untrained model (a job with an SFT warm-up)
    from_base = {s: 100 * (seat_rates(end, s)["win_rate"] - seat_rates(base, s)["win_rate"]) for s in SEATS} if base else None
    best = max(curve[1:], key=lambda c: sum(c[s]["win_rate"] for s in SEATS))
    return {"seed": seed, "wall_s": wall_s, "job_dir": str(job_dir), "best_step": best["step"], "rl_start": {s: seat_rates(start_row, s) for s in SEATS},
            "end": {s: seat_rates(end, s) for s in SEATS}, "end_step": end["step"], "gain_points": gains,
            "gain_from_base_points": from_base,
            "curve": curve, "run": run}


def plot(results: list[dict], path: Path) -> None:
    """Win rate against the opponent per seat over steps (RL only; step 0 = after the SFT warm-up), and Elo."""

    def draw(axes) -> None:
        left, right = axes
        for r in results:
            rl = [c for c in r["curve"] if c["phase"] != "base"]
            for seat, style in zip(SEATS, ("-", "--")):
                left.plot([c["step"] for c in rl], [100 * c[seat]["win_rate"] for c in rl], style, marker="o",
                          label=f"seed {r['seed']}, {seat}")
            right.plot([c["step"] for c in rl], [c["elo"].get("main") for c in rl], marker="o",
                       label=f"seed {r['seed']}: policy")
            right.plot([c["step"] for c in rl], [c["elo"].get(OPPONENT) for c in rl], ":",
                       label=f"seed {r['seed']}: opponent")
        left.set(xlabel="RL step (0 = after the SFT warm-up)", ylabel="win rate vs heuristic, p_random=0.3 (%)",
                 title="Gomoku 4x4, three in a row")
        right.set(xlabel="RL step", ylabel="Elo (random = 1000)", title="Elo table of the job")
        left.legend(fontsize=8)
        right.legend(fontsize=8)

    save_plot(path, draw, panels=2, size=(11, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--config", default=CONFIG, help="a Gomoku game config (conf/gpu/gomoku_4m.yaml on a GPU)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_gomoku")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--local", action="store_true", help="python -m otray.train: no ResourceManager")
    parser.add_argument("--collect", type=Path, nargs="+", help="only summarize these job directories (seeds in order)")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every seed")
    args = parser.parse_args()
    if args.collect:
        results = [summarize(s, d, None) for s, d in zip(args.seeds, args.collect)]
    else:
        results = [run_seed(s, args.overrides, args.runs, args.config, args.local) for s in args.seeds]
    summary = {"config": args.config, "overrides": args.overrides, "opponent": "scripted:envs.gomoku:heuristic(random_prob=0.3)",
               "passed": all(g >= 15 for r in results for g in r["gain_points"].values()), "seeds": results}
    args.out.write_text(json.dumps(summary, indent=1))
    plot(results, args.out.with_suffix(".png"))
    for r in results:
        for s in SEATS:
            a, b = r["rl_start"][s], r["end"][s]
            print(f"seed {r['seed']} {s}: win {a['win_rate']:.3f} -> {b['win_rate']:.3f} ({r['gain_points'][s]:+.1f} points), "
                  f"loss {b['loss_rate']:.3f}, draw {b['draw_rate']:.3f}, timeout {b['timeout_rate']:.3f}, "
                  f"illegal/game {b['illegal_per_game']:.2f} at step {r['end_step']}")
        print(f"seed {r['seed']}: best eval at step {r['best_step']}; {r['wall_s'] or 0:.0f} s")
    print(f"passed (>= 15 points in both seats, every seed): {summary['passed']}; saved {args.out}")


if __name__ == "__main__":
    main()
