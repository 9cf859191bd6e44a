"""Saving a benchmark's figures: one JSON file under ``benchmarks/results/`` (or where ``--out`` says)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save(result: dict, out: str | Path) -> Path:
    """Write ``result`` as indented JSON to ``out`` (its folder made if needed); say where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")
    return path
