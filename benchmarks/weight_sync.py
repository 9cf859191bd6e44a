"""Weight sync between a learner actor and a rollout worker actor on one node, every transport side by side.

    python benchmarks/weight_sync.py [--shape 100m] [--rounds 5] [--gpu]

Both actors are real (a PolicyLearner and an HF RolloutWorker, full-parameter, the worker's dtype sent);
each round times one ``PolicyRuntime.sync_weights`` path per transport (``object_store``, ``shm``,
``broadcast`` and, with ``--gpu``, ``cuda_ipc``: both actors on half of one GPU), rotating which goes first.
Prints the medians and their ratios to the object store and saves ``benchmarks/results/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="100m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu", action="store_true", help="both actors on half of one GPU (adds cuda_ipc)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_sync.json"))
    args = ap.parse_args(argv)

    import ray

    from otray.actors.job.runtime import open_broadcast
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.fleet import RolloutFleet
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.models import resolve_model_path

    path = resolve_model_path("tiny" if args.shape == "tiny" else f"tiny-{args.shape}", ROOT / ".cache" / "models")
    ray.init(address="local", num_cpus=2, num_gpus=1 if args.gpu else 0, include_dashboard=False, log_to_driver=False)
    gpus = 0.5 if args.gpu else 0
    learner = ray.remote(num_cpus=1, num_gpus=gpus)(PolicyLearner).remote(path, dtype="auto")
    worker = ray.remote(num_cpus=1, num_gpus=gpus)(RolloutWorker).remote(path, "hf", dtype="auto", sampler="eager")
    fleet = RolloutFleet([worker])
    ray.get([learner.ping.remote(), worker.ping.remote()])
    dtype = ray.get(worker.info.remote()).dtype
    transports = ["object_store", "shm", *(["broadcast"] if not args.gpu else []), *(["cuda_ipc"] if args.gpu else [])]
    if "broadcast" in transports:  # NCCL refuses two ranks on one GPU: on a GPU this pair takes cuda_ipc
        open_broadcast(learner, [worker])
    times: dict[str, list[float]] = {t: [] for t in transports}
    for r in range(args.rounds + 1):  # round 0 warms every path up
        for transport in transports[r % len(transports):] + transports[:r % len(transports)]:
            t0 = time.perf_counter()
            update = learner.weights.remote(transport, dtype)  # then the broadcast (an actor runs calls in order)
            sender = learner.send_weights.remote() if transport == "broadcast" else None
            fleet.update_weights(update, None, sender)
            if r:
                times[transport].append(time.perf_counter() - t0)
    info = ray.get(learner.info.remote())
    ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"shape": args.shape, "device": "cuda" if args.gpu else "cpu", "dtype": dtype, "rounds": args.rounds,
              "median_s": med, "times_s": times, "over_object_store": {k: v / med["object_store"] for k, v in med.items()},
              "learner_step": info.step}
    print(f"{args.shape} ({dtype}, {result['device']}), median of {args.rounds} syncs: " + ", ".join(
        f"{k} {v:.4f} s ({result['over_object_store'][k]:.2f})" for k, v in med.items()))
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
