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


def save_plot(path: str | Path, draw, *, panels: int = 1, size: tuple[float, float] = (7, 4)) -> Path:
    """A PNG a person can look at: ``draw(axes)`` fills ``panels`` side-by-side matplotlib axes (one axes
    object when ``panels`` is 1). Needs matplotlib (``pip install -e '.[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size)
    draw(axes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"saved {path}")
    return Path(path)
