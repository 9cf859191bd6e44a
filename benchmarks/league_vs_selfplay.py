"""Plain self-play against league play, side by side: ``python benchmarks/league_vs_selfplay.py [--seeds 0] [--steps 150]``.

tinker-cookbook's tic-tac-toe self-play collapses into a degenerate equilibrium around steps 80-110 (its
README). Here the same game (PettingZoo's ``tictactoe_v3``, ``conf/tictactoe_vs_random.yaml`` with both
seats ``trained``: one policy plays itself) is trained twice per seed for the same steps, one run after
another (never beside the test suite):

- ``selfplay``: every game against the current policy;
- ``league``: ``game.league`` on: a checkpoint joins the pool every ``--every`` steps, half of each
  step's seeds are played against the league (a snapshot drawn by PFSP, or 25% of the time random).

Both are evaluated every ``--every`` steps in both seats against fixed references: the scripted
heuristic (win, block, centre, corner) and random. Saved: ``benchmarks/results/league_vs_selfplay.json``
(every eval row of every run) and ``.png`` (win + draw rate against the heuristic, per seat, over steps).
``collapse``: for each run, the drop from its best eval to its last in score against the heuristic
(win + half a draw, mean over seats); the league avoids the collapse where self-play's drop is larger.

Both variants charge ``--illegal-penalty`` (default 0.2) per unreadable or illegal reply. Without it
(``--illegal-penalty 0``, session 21) plain self-play lost its reply format within 25 steps: an
unreadable reply is replaced by a random legal move and costs nothing, so the format tokens drift
(``<move>8</0</move``), and once every reply is unreadable the seeded fallback moves make each group's
games identical (uniform groups, no gradient): a collapse of the format, not of play, that hides
the one the comparison is for.
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

OUT = ROOT / "benchmarks" / "results" / "league_vs_selfplay.json"
SEATS = ("player_1", "player_2")


def variants(every: int) -> dict[str, list[str]]:
    selfplay = ["game.policies.player_2=trained"]
    league = selfplay + [f"game.league.every={every}", "game.league.share=0.5", "game.league.fixed=[random]",
                         "game.league.fixed_share=0.25"]
    return {"selfplay": selfplay, "league": league}


def score(row: dict, opponent: str = "heuristic") -> float:
    """Mean over seats of win + half a draw against ``opponent``."""
    return sum(row[f"eval/{s}_vs_{opponent}/win_rate"] + 0.5 * row[f"eval/{s}_vs_{opponent}/draw_rate"]
               for s in SEATS) / len(SEATS)


def run(name: str, seed: int, overrides: list[str], runs: Path) -> dict:
    out = runs / f"{name}_s{seed}"
    start = time.monotonic()
    subprocess.run([str(ROOT / ".venv" / "bin" / "otray"), "train", str(ROOT / "conf" / "tictactoe_vs_random.yaml"),
                    f"job.seed={seed}", f"job.output_dir={out}", *overrides], check=True, cwd=ROOT)
    job_dir = max(out.iterdir(), key=lambda p: p.stat().st_mtime)
    return summarize(name, seed, job_dir, time.monotonic() - start, overrides)


def summarize(name: str, seed: int, job_dir: Path, wall_s: float | None, overrides: list[str]) -> dict:
    """One run's figures from its job directory (also for runs made earlier: ``--collect``)."""
    rows = collect(job_dir)["eval_rows"]
    rl = [r for r in rows if r["phase"] != "base"]
    scores = [score(r) for r in rl]
    return {"variant": name, "seed": seed, "wall_s": wall_s, "job_dir": str(job_dir), "overrides": overrides,
            "score_vs_heuristic": [{"step": r["step"], "score": s} for r, s in zip(rl, scores)],
            "best": max(scores), "last": scores[-1], "drop_from_best": max(scores) - scores[-1], "eval_rows": rows}


def plot(results: list[dict], path: Path) -> None:
    """Three panels over RL steps, from each run's eval rows: score against the heuristic (the reference
    for the collapse), against random, and the policy's Elo in the job's table (random = 1000)."""

    def draw(axes) -> None:
        panels = [(lambda row: score(row), "score vs heuristic (win + draw/2, both seats)"),
                  (lambda row: score(row, "random"), "score vs random (win + draw/2, both seats)"),
                  (lambda row: row.get("elo/main"), "Elo of the trained policy (random = 1000)")]
        for ax, (value, label) in zip(axes, panels):
            for r in results:
                rl = [row for row in r["eval_rows"] if row["phase"] != "base"]
                ax.plot([row["step"] for row in rl], [value(row) for row in rl],
                        "-" if r["variant"].startswith("league") else "--", marker="o",
                        label=f"{r['variant']}, seed {r['seed']}")
            ax.set(xlabel="RL step (0 = after the format-only SFT)", ylabel=label)
            ax.legend(fontsize=8)
        axes[0].set_title("Tic-tac-toe: plain self-play vs league play")

    save_plot(path, draw, panels=3, size=(15, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=15, help="steps between evals and between league snapshots")
    parser.add_argument("--illegal-penalty", type=float, default=0.2,
                        help="game.illegal_penalty of both variants (0: replies' format may drift, see the docstring)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_league")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--replot", action="store_true", help="only draw the PNG again from the saved JSON (--out)")
    parser.add_argument("--collect", nargs="+", metavar="VARIANT=JOB_DIR",
                        help="only summarize these finished job directories (seed: the first of --seeds)")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text())["runs"], args.out.with_suffix(".png"))
        return
    if args.collect:
        results = [summarize(v, args.seeds[0], Path(d), None, []) for v, d in (c.split("=", 1) for c in args.collect)]
        args.out.write_text(json.dumps({"config": "conf/tictactoe_vs_random.yaml", "collected": args.collect,
                                        "runs": results}, indent=1))
        plot(results, args.out.with_suffix(".png"))
        print(f"saved {args.out}")
        return
    common = [f"algo.steps={args.steps}", f"eval.every={args.every}", "game.eval_games=100",
              f"game.illegal_penalty={args.illegal_penalty}",
              "resources.rollout_cpus=0.5"]  # the league's snapshot worker is one more rollout bundle: 2 CPUs in all
    results = [run(name, seed, common + extra, args.runs)
               for seed in args.seeds for name, extra in variants(args.every).items()]
    summary = {"config": "conf/tictactoe_vs_random.yaml", "common_overrides": common, "runs": results}
    args.out.write_text(json.dumps(summary, indent=1))
    plot(results, args.out.with_suffix(".png"))
    for r in results:
        print(f"{r['variant']:9} seed {r['seed']}: score vs heuristic best {r['best']:.3f}, last {r['last']:.3f} "
              f"(drop {r['drop_from_best']:.3f}); {r['wall_s'] or 0:.0f} s")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
