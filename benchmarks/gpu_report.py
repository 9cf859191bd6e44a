"""One JSON of a ``make gpu-check`` run: what each part wrote, and issue 51's targets read off it.

    python benchmarks/gpu_report.py --dir benchmarks/results --out benchmarks/results/gpu_report.json

Reads (each may be missing: a part that failed or timed out is reported as such) ``gpu_tests.log`` (pytest's
last line), ``gpu.json`` (``benchmarks/gpu.py``: otray against TRL), ``gpu_check.json`` (the engine's probes),
``learner_fairness.json``, ``tinker_shared_passes.json`` (issue 53: shared passes against a pass per
user, N = 8 target >= 5x, and the bucketed passes' CUDA graphs: read off into ``issue53``) and
``gpu_manager_job.log`` (its last lines). Targets on one H100/H200: colocated
compiled step / TRL's <= 0.30 (goal 0.15), compiled generation of the step's 64 x 256 tokens <= 1.5 s, weight
sync between a learner and a worker on one GPU <= 0.05 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402

TARGETS = {"compiled_over_trl": 0.30, "compiled_generate_s": 1.5, "split_sync_s": 0.05}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_lines(path: Path, n: int) -> list[str] | None:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return None


def targets(gpu: dict | None) -> dict:
    if not gpu:
        return {"missing": "gpu.json (benchmarks/gpu.py did not finish)"}
    rows = gpu["rows"]
    got = {"compiled_over_trl": rows.get("otray_colocated_compiled", {}).get("ratio_to_trl"),
           "compiled_generate_s": rows.get("otray_colocated_compiled", {}).get("generate_s"),
           "split_sync_s": rows.get("otray_split", {}).get("sync_s")}
    # met: None where the row did not run (not measured is not a miss)
    return {k: {"value": v, "target": TARGETS[k], "met": None if v is None else v <= TARGETS[k]} for k, v in got.items()}


def shared_passes(tsp: dict | None) -> dict:
    """Issue 53's figures read off ``tinker_shared_passes.json``: N = 8 shared and bucketed (CUDA graphs) learners'
    throughput over a pass per user (target >= 5x), the in-process bucketed step over the routed one, its capture
    failures. None where that part or row did not run."""
    if not tsp:
        return {"missing": "tinker_shared_passes.json (benchmarks/tinker_shared_passes.py did not finish)"}
    row, kern = (tsp.get("throughput") or {}).get("8") or {}, (tsp.get("kernels") or {}).get("graphs_8") or {}
    out: dict = {}
    for mode in ("shared", "graphs"):
        v = row.get(f"{mode}_over_own")
        out[f"{mode}_over_own_at_8"] = {"value": v, "target": 5.0, "met": None if v is None else v >= 5.0}
    out["graphs_kernels_over_routed_at_8"] = kern.get("over_routed")
    out["graph_captures_at_8"] = (kern.get("counts") or {}).get("captures")
    out["graph_capture_failures"] = kern.get("failures")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    d = Path(a.dir)
    gpu = read_json(d / "gpu.json")
    report = {"tests": last_lines(d / "gpu_tests.log", 1), "vs_trl": gpu, "targets": targets(gpu),
              "probes": read_json(d / "gpu_check.json"), "learner_fairness": read_json(d / "learner_fairness.json"),
              "tinker_shared_passes": read_json(d / "tinker_shared_passes.json"),
              "manager_job": last_lines(d / "gpu_manager_job.log", 4)}
    report["issue53"] = shared_passes(report["tinker_shared_passes"])
    print(f"issue 53: {report['issue53']}")
    for name, t in report["targets"].items():
        print(f"{name}: {t}" if not isinstance(t, dict) else
              f"{name}: {t['value']} (target <= {t['target']}: {'not measured' if t['met'] is None else 'met' if t['met'] else 'not met'})")
    save(report, a.out or d / "gpu_report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
