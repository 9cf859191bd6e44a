"""Weight sync between a learner actor and a rollout worker actor on one node: object store vs shared memory.

    python benchmarks/weight_sync.py [--shape 100m] [--rounds 5]

Both actors are real (a PolicyLearner and an HF RolloutWorker, full-parameter); each round times one
``fleet.update_weights(learner.weights.remote(transport))`` per transport, alternating which goes first.
Prints the medians and their ratio and saves ``benchmarks/results/weight_sync.json``. (On a GPU the
same script measures the CPU hop of both; CUDA IPC would skip it and is not built yet.)
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
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_sync.json"))
    args = ap.parse_args(argv)

    import ray

    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.fleet import RolloutFleet
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.models import resolve_model_path

    path = resolve_model_path("tiny" if args.shape == "tiny" else f"tiny-{args.shape}", ROOT / ".cache" / "models")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    learner = ray.remote(num_cpus=1)(PolicyLearner).remote(path, dtype="float32")
    worker = ray.remote(num_cpus=1)(RolloutWorker).remote(path, "hf")
    fleet = RolloutFleet([worker])
    ray.get([learner.ping.remote(), worker.ping.remote()])
    times: dict[str, list[float]] = {"object_store": [], "shm": []}
    for r in range(args.rounds + 1):  # round 0 warms both paths up
        order = ["object_store", "shm"] if r % 2 else ["shm", "object_store"]
        for transport in order:
            t0 = time.perf_counter()
            fleet.update_weights(learner.weights.remote(transport))
            if r:
                times[transport].append(time.perf_counter() - t0)
    info = ray.get(learner.info.remote())
    ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"shape": args.shape, "rounds": args.rounds, "median_s": med, "times_s": times,
              "shm_over_object_store": med["shm"] / med["object_store"], "learner_step": info.step}
    print(f"{args.shape}: object store {med['object_store']:.3f} s, shared memory {med['shm']:.3f} s "
          f"(ratio {result['shm_over_object_store']:.2f}) per sync, median of {args.rounds}")
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
