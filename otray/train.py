"""``python -m otray.train CONFIG [key=value ...]``: run one training job on a local Ray, without the
ResourceManager (benchmarks, tests). The job loop itself is ``otray.actors.job.run.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from otray import config as config_mod
from otray.actors.job.run import run
from otray.placement import cluster_env
from otray.types import OtrayError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otray.train", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or "local",
                        help="Ray cluster (default: RAY_ADDRESS, else start a local one; auto: the last `ray start`)")
    args = parser.parse_args(argv)
    try:
        cfg = config_mod.load(args.config, args.overrides)
    except OtrayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    ray.init(address=args.address, include_dashboard=False, log_to_driver=True,
             **cluster_env(args.address, {"VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_gb),
                                          "TOKENIZERS_PARALLELISM": "false"}))
    job_dir = Path(cfg.job.output_dir) / cfg.job.name
    try:
        summary = run(cfg, job_dir)
    except OtrayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
