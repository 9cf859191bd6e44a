"""Where a job's metrics rows go besides JSONL: wandb and Ray's metrics API.

wandb runs offline by default (files under ``<job dir>/wandb``; ``wandb sync`` uploads
them later). Ray gauges are named ``otray_<metric>`` (non-alphanumerics -> ``_``) with a
``job`` tag; each node's metrics agent serves them to Prometheus as ``ray_otray_<metric>``
(port ``MetricsExportPort`` in ``ray.nodes()``, or ``ray start --metrics-export-port``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from otray.config import Config, to_dict


class MetricSinks:
    def __init__(self, cfg: Config, job_dir: Path | None, job_name: str):
        self.run = None
        self.gauges: dict[str, Any] = {}
        self.job = job_name
        self.ray_metrics = cfg.logging.ray_metrics
        if cfg.logging.wandb:
            import wandb

            self.run = wandb.init(project=cfg.logging.wandb_project, name=job_name, dir=str(job_dir),
                                  mode=cfg.logging.wandb_mode, config=to_dict(cfg), reinit="create_new")

    def log(self, row: dict[str, Any]) -> None:
        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.run is not None:
            self.run.log(numeric, step=int(row.get("step", 0)))
        if self.ray_metrics:
            from ray.util.metrics import Gauge

            for key, value in numeric.items():
                name = "otray_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                if name not in self.gauges:
                    self.gauges[name] = Gauge(name, description=f"otray job metric {key}", tag_keys=("job",))
                self.gauges[name].set(value, tags={"job": self.job})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
