"""Sharded learner scaling: step time and peak memory per rank for N = 1 and N = 2 learners.

Trains the ~100M-parameter generated model (``tiny-100m``, 16 layers, hidden 768) with every
parameter trainable, on one fixed batch, side by side in this script:

- ``N=1``: one PolicyLearner actor (today's learner), 1 torch thread, and again with 2;
- ``N=2``: a LearnerGroup over two LearnerRank actors (FSDP2 over gloo), 1 thread each.

The actors run with ``MALLOC_MMAP_THRESHOLD_=65536`` (``--mmap-threshold``; 0 = glibc's default).
Why: glibc raises its mmap threshold as big buffers are freed, after which freed memory stays
in the heap and counts in the resident set; with the default a rank's RSS after one
forward_backward stayed ~1 GB above its live tensors (measured: 1.7-2.0 GB resident, 0.9 GB
with the fixed threshold), which hides what sharding saves. Both figures are reported.

Each run: one warm-up step (creates the optimizer state), then ``--steps`` timed steps of
forward_backward + optim_step. Memory is each actor process's peak resident set (``VmHWM``)
and that peak minus the resident set of a process that imported the same code but holds no
model (``floor``): the part that is the model's training state and activations, the part
sharding divides. On a machine with GPUs, ``--device cuda`` reports
``torch.cuda.max_memory_allocated`` per rank instead (``--shape`` picks a bigger model).

    python benchmarks/learner_scaling.py [--steps 3] [--shape 100m] [--device cpu]

Prints a table and writes ``benchmarks/results/learner_scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def batch(n: int, length: int, seed: int = 0):
    from otray.types import Datum

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 500) for _ in range(length + 1)]
        mask = [0.0] * 16 + [1.0] * (length - 16)
        out.append(Datum(ids[:-1], ids[1:], mask, [0.0] * length, [0.0] * length, list(mask)))
    return out


def memory_of(pid: int) -> dict[str, float]:
    """Peak and current resident set of a process, in MiB (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS")}


class Floor:
    """A process that imports what a learner imports and holds no model: the resident-set floor."""

    def pid(self) -> int:
        import importlib

        for name in ("otray.actors.learner.policy_learner", "otray.actors.learner.rank", "torch.distributed.fsdp"):
            importlib.import_module(name)  # the imports are the point

        return os.getpid()


def run(ray, model: str, n: int, threads: int, steps: int, data, device: str, mmap_threshold: int) -> dict:
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.learner.group import LearnerGroup
    from otray.actors.learner.rank import LearnerRank

    kw = dict(micro_batch_tokens=4096, seed=0, num_threads=threads, device=device)
    env = {"OMP_NUM_THREADS": str(threads)}
    if mmap_threshold:  # see the module docstring: glibc keeps freed buffers, RSS then hides sharding
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    opts = dict(num_cpus=1, num_gpus=1 if device == "cuda" else 0, runtime_env={"env_vars": env})
    if n == 1:
        ranks = [ray.remote(**opts)(PolicyLearner).remote(model, **kw)]
        handle = ranks[0]
    else:
        ranks = [ray.remote(**opts)(LearnerRank).remote(model, rank=r, world_size=n, **kw) for r in range(n)]
        handle = ray.remote(num_cpus=0)(LearnerGroup).remote(ranks, 4096, 600.0)
    ray.get(handle.ping.remote())
    pids = ray.get([r.__ray_call__.remote(lambda self: os.getpid()) for r in ranks])
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        ray.get(handle.forward_backward.remote(data, "cross_entropy", {}, "token_mean"))
        ray.get(handle.optim_step.remote(1e-5, (0.9, 0.999), 1e-8, 0.0, 1.0))
        if i:  # the first step also allocates the optimizer state
            times.append(time.perf_counter() - t0)
    if device == "cuda":
        peaks = ray.get([r.__ray_call__.remote(lambda self: __import__("torch").cuda.max_memory_allocated() / 2**20)
                         for r in ranks])
        mem = [{"cuda_peak_mib": p} for p in peaks]
    else:
        mem = [memory_of(p) for p in pids]
    for h in (*ranks, handle):
        ray.kill(h)
    return {"learners": n, "threads_each": threads, "mmap_threshold": mmap_threshold,
            "step_s": sorted(times)[len(times) // 2], "per_rank": mem}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", default="100m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--mmap-threshold", type=int, default=65536)
    args = ap.parse_args()

    import ray

    from otray.models import resolve_model_path

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = resolve_model_path(f"tiny-{args.shape}", str(ROOT / ".cache" / "models"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        floor_actor = ray.remote(num_cpus=0)(Floor).remote()
        floor = memory_of(ray.get(floor_actor.pid.remote()))["VmRSS"] if args.device == "cpu" else 0.0
        data = batch(args.datums, args.length)
        t = args.mmap_threshold
        if args.device == "cuda":  # one GPU per rank: NCCL refuses two ranks on one GPU
            gpus = int(ray.cluster_resources().get("GPU", 0))
            if gpus < 2:
                raise SystemExit(f"--device cuda compares 1 and 2 ranks, one GPU each; this machine has {gpus}")
        runs = [run(ray, model, 1, 1, args.steps, data, args.device, t),
                run(ray, model, 1, 2, args.steps, data, args.device, t),
                run(ray, model, 2, 1, args.steps, data, args.device, t),
                run(ray, model, 1, 1, args.steps, data, args.device, 0),  # glibc's default: what RSS shows then
                run(ray, model, 2, 1, args.steps, data, args.device, 0)]
    finally:
        ray.shutdown()
    for r in runs:
        for m in r["per_rank"]:
            if "VmHWM" in m:
                m["state_mib"] = m["VmHWM"] - floor
    key = "cuda_peak_mib" if args.device == "cuda" else "state_mib"
    single = max(m[key] for m in runs[0]["per_rank"])
    sharded = max(m[key] for m in runs[2]["per_rank"])
    result = {
        "command": "python benchmarks/learner_scaling.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores, device {args.device}; nothing else running",
        "model": f"tiny-{args.shape}", "batch": f"{args.datums} x {args.length} tokens, full-parameter, AdamW",
        "floor_rss_mib": floor, "runs": runs,
        "memory_per_rank_ratio_2_vs_1": sharded / single,
        "target": "memory per rank with N=2 <= 0.6 x N=1 (full-parameter)",
        "met": sharded / single <= 0.6,
    }
    default_single = max(m[key] for m in runs[3]["per_rank"])
    default_sharded = max(m[key] for m in runs[4]["per_rank"])
    result["memory_per_rank_ratio_glibc_default"] = default_sharded / default_single
    print(f"{'learners':>8} {'threads':>7} {'mmap_thr':>8} {'step_s':>7}  per-rank peak MiB (" + key + ")")
    for r in runs:
        print(f"{r['learners']:>8} {r['threads_each']:>7} {r['mmap_threshold']:>8} {r['step_s']:>7.2f}  "
              + ", ".join(f"{m[key]:.0f}" for m in r["per_rank"]))
    print(f"memory per rank, N=2 / N=1: {sharded / single:.2f} (target <= 0.6); floor {floor:.0f} MiB")
    out = ROOT / "benchmarks" / "results" / "learner_scaling.json"
    out.write_text(json.dumps(result, indent=1))
    print("saved", out)


if __name__ == "__main__":
    main()
