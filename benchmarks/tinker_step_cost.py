"""Where a Tinker learner's step goes: one small user's step beside a big user's, part by part.

The fairness benchmarks (``learner_fairness.py``) showed on an H200 (0.5B shape) that bob's one-datum
step (one ~16-token datum: forward_backward, then optim_step) costs 0.19 s of learner time, more than
alice's forward_backward of 8 x 128 tokens (0.11 s). While that holds, bob's pauses bound what alice
keeps, whatever the scheduler does. This script times the parts of each step on an
:class:`~otray.tinker.learner.adapter_learner.AdapterLearner` (no Ray, no queue), synchronising the device around each
part, and lists the operators a profiler sees in bob's step (the CPU side: Python and kernel launches).

    python benchmarks/tinker_step_cost.py [--shape 0.5b] [--adapters 11] [--repeats 20]

Prints the figures and writes ``benchmarks/results/tinker_step_cost.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402


def timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> dict[str, float]:
    """Median and p90 seconds of ``fn`` over ``repeats`` calls (the device synchronised around each)."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_s": statistics.median(times), "p90_s": times[int(0.9 * (len(times) - 1))]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b", help="a tiny model shape: tiny, 4m, 100m, 0.5b, 1.5b")
    ap.add_argument("--adapters", type=int, default=11, help="adapters on the learner (alice's 10 and bob's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tinker_step_cost.json"))
    args = ap.parse_args(argv)
    import torch

    from otray.models import load_tokenizer, resolve_model_path
    from otray.tinker.learner.adapter_learner import AdapterLearner
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.types import Datum

    path = resolve_model_path("tiny" if args.shape == "tiny" else f"tiny-{args.shape}", ROOT / ".cache" / "models")
    learner = AdapterLearner(path, device=args.device)
    sync = torch.cuda.synchronize if learner.device.startswith("cuda") else (lambda: None)
    tok = load_tokenizer(path)

    def datum(tokens: list[int]) -> Datum:
        n = len(tokens) - 1
        return Datum(tokens[:-1], tokens[1:], [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)

    text = tok.encode("the answer is the sum of the number you are a helpful assistant " * 40)
    data = {"alice": [datum(text[i:i + 129]) for i in range(8)],
            "bob": [datum(tok.encode("12 plus 30 is 42, so the answer is 42."))]}
    names = [f"a{i}" for i in range(args.adapters - 1)] + ["bob"]
    for i, name in enumerate(names):
        learner.create(name, AdapterSpec(32, i))
    adam = AdamStep(learning_rate=1e-5)
    for name in names:  # every adapter's optimizer made and warm
        learner.forward_backward(name, data["bob"], "cross_entropy")
        learner.optim_step(name, adam)
    user_adapter = {"alice": "a0", "bob": "bob"}
    parts: dict[str, Any] = {}
    for user, adapter in user_adapter.items():
        other = "a1" if user == "bob" else "bob"  # switch away first, as a shared learner does between users

        def switch() -> None:
            learner.switch.use(learner.model, other)
            learner.switch.use(learner.model, adapter)

        parts[user] = {
            "switch_there_and_back": timed(switch, sync, args.repeats),
            "forward_backward": timed(lambda: learner.forward_backward(adapter, data[user], "cross_entropy"),
                                      sync, args.repeats),
            "forward_only": timed(lambda: learner.forward_backward(adapter, data[user], "cross_entropy",
                                                                   backward=False), sync, args.repeats),
            "optim_step": timed(lambda: (learner.forward_backward(adapter, data[user], "cross_entropy"),
                                         learner.optim_step(adapter, adam)), sync, args.repeats),
        }
        parts[user]["optim_step_alone_s"] = (parts[user]["optim_step"]["median_s"]
                                             - parts[user]["forward_backward"]["median_s"])
        print(user, {k: round(v["median_s"] if isinstance(v, dict) else v, 4) for k, v in parts[user].items()},
              flush=True)
    from torch.profiler import ProfilerActivity, profile

    cuda = learner.device.startswith("cuda")  # with CUDA: the runtime calls too (cudaLaunchKernel: launches)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(3):
            learner.forward_backward("bob", data["bob"], "cross_entropy")
            learner.optim_step("bob", adam)
        sync()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    top = [{"op": e.key, "calls_per_step": e.count / 3, "self_cpu_ms_per_step": e.self_cpu_time_total / 3e3}
           for e in events]
    for row in top[:15]:
        print(f"{row['op'][:60]:60} {row['calls_per_step']:8.0f} calls {row['self_cpu_ms_per_step']:8.2f} ms")
    save({"shape": args.shape, "device": learner.device, "dtype": str(learner.base.dtype), "adapters": args.adapters,
          "parts": parts, "bob_step_cpu_profile": top}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
