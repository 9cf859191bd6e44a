"""Gather learning runs into one JSON: ``python benchmarks/collect_runs.py OUT.json NAME=RUN_DIR ...``.

Each ``RUN_DIR`` is a job directory (``metrics.jsonl``, ``summary.json``, ``config.json``);
the JSON keeps, per run, the config's seed, the summary, and every row that carries
an evaluation (``eval/...`` keys), which is what the README's before/after tables cite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def collect(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((run_dir / "config.json").read_text())
    return {"run_dir": str(run_dir), "seed": config["job"]["seed"],
            # a run stopped early has no summary
            "summary": json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None,
            "eval_rows": [{k: v for k, v in r.items() if k in ("step", "phase") or k.startswith(("eval/", "sft_", "elo/"))}
                          for r in rows if any(k.startswith("eval/") for k in r)]}


def main(argv: list[str]) -> None:
    out, pairs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    result = {name: collect(Path(path)) for name, path in pairs}
    out.write_text(json.dumps(result, indent=1))
    for name, run in result.items():
        evals = [(r["step"], r["phase"], r.get("eval/accuracy")) for r in run["eval_rows"]]
        print(name, ", ".join(f"{s}/{p}: {a:.3f}" for s, p, a in evals if a is not None))


if __name__ == "__main__":
    main(sys.argv[1:])
