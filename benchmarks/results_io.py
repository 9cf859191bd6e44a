"""Saving a benchmark's figures: one JSON file under ``benchmarks/results/`` (or where ``--out`` says)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """The CPU the figures came from (its model name, cores, widest vector unit): figures from the AMD Zen 4,
    AVX2 AMD and Intel Xeon machines these sessions ran on differ by up to 2x for the same code."""
    import os

    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    vector = next((v for v in ("avx512f", "avx2") if v in flags), "other")
    # usable: the cores this process may run on (session 65's shell was pinned to one of its two: `taskset -p $$`)
    return {"cpu": name, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "vector": vector}


def save(result: dict, out: str | Path) -> Path:
    """Write ``result`` as indented JSON to ``out`` (its folder made if needed), with the machine it ran on
    (:func:`machine`, unless the result names one); say where."""
    result = {**result, "machine": result.get("machine") or machine()}
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
