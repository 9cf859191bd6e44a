"""What the Tinker API costs: the same SFT and RL steps through the ``tinker`` SDK over HTTP and as
direct calls on an in-process AdapterLearner, side by side in this script.

Model: the ~100M generated model (``tiny-100m``), a rank-32 LoRA adapter, 2 torch threads on
both sides (the service's learner actor gets the same). Steps, each timed after one warm-up:

- SFT: ``forward_backward`` (cross_entropy, ``--batch`` datums) + ``optim_step``;
- RL: sampler weights saved (``rl_sampling``: up to here, then the training part), ``--prompts`` prompts x ``--group`` samples of ``--max-tokens``
  tokens, then ``forward_backward`` (importance_sampling) on every sample + ``optim_step``.

The SDK side goes through everything a user's client does: HTTP, the gateway, the service
actor (promises, seq_id order), the learner actor; the in-process side calls the learner's
methods directly. Overhead = (SDK step - in-process step) / in-process step; target <= 15%.

    python benchmarks/tinker_api.py [--steps 3] [--shape 100m]

Prints a table and writes ``benchmarks/results/tinker_api.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_API_KEY", "tml-local")
PORT = 8031
THREADS = 2


def data(tok, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        prompt = tok.encode(f"Question: what is {a} plus {b}? Think, then answer. Answer: ")
        out.append((prompt, tok.encode(f"{a} plus {b} is {a + b}, so the answer is {a + b}.")))
    return out


def in_process(path: str, args, pairs, prompts) -> dict[str, list[float]]:
    import torch

    from otray.tinker.learner.adapter_learner import AdapterLearner
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.tinker.learner.sample_jobs import SampleJob
    from otray.types import Datum, SamplingParams

    torch.set_num_threads(THREADS)
    learner = AdapterLearner(path)
    learner.create("bench", AdapterSpec(32, 0))
    sft = [Datum(p + a[:-1], (p + a)[1:], [1.0] * (len(p) + len(a) - 1), [0.0] * (len(p) + len(a) - 1),
                 [0.0] * (len(p) + len(a) - 1), [0.0] * (len(p) - 1) + [1.0] * len(a)) for p, a in pairs]
    times: dict[str, list[float]] = {"sft": [], "rl": [], "rl_sampling": []}
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        learner.forward_backward("bench", sft, "cross_entropy")
        learner.optim_step("bench", AdamStep(learning_rate=1e-4))
        times["sft"].append(time.perf_counter() - t0)
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        sampler_dir = Path(args.tmp) / f"inproc-sampler-{i}"  # a new one per step, as the SDK's ephemeral saves
        learner.save("bench", str(sampler_dir), optimizer=False)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
        outs = learner.sample([SampleJob(str(sampler_dir), prompts, params, args.group)])[0]
        times["rl_sampling"].append(time.perf_counter() - t0)
        rl = []
        for p, out in zip(prompts, outs):
            for s in out.samples:
                seq = p + s.token_ids
                n = len(seq) - 1
                rl.append(Datum(seq[:-1], seq[1:], [1.0] * n, [0.0] * (len(p) - 1) + [0.5] * len(s.token_ids),
                                [0.0] * (len(p) - 1) + s.logprobs))
        learner.forward_backward("bench", rl, "importance_sampling")
        learner.optim_step("bench", AdamStep(learning_rate=1e-4))
        times["rl"].append(time.perf_counter() - t0)
    return times


def through_sdk(path: str, args, pairs, prompts, engine: str = "learner",
                train_unembed: bool = True, gpu: bool = False) -> dict[str, list[float]]:
    """The steps through the SDK against a fresh service whose sampler is ``engine`` (``learner``: the
    in-process side's HF generate; ``vllm``: benchmarks/tinker_sampler.py); ``gpu``: the learner and
    the vLLM sampler share one GPU, half each."""
    gpus = {"learner_gpus": 0.5} if gpu else {}
    sampler = {"engine": engine, "num_threads": THREADS, **({"gpus": 0.5, "gpu_memory_utilization": 0.4} if gpu else {})}
    import ray
    import tinker
    from tinker import types

    from otray.tinker.gateway.app import run
    from otray.tinker.config import load_tinker

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, log_to_driver=False)
    run(load_tinker({"port": PORT, "auth": "off", "storage": str(Path(args.tmp) / "store"),
                     "sample_batch_wait_ms": args.batch_wait_ms,
                     "models": [{"name": "m", "path": path, "learner_cpus": 1, "num_threads": THREADS,
                                 "sampler": sampler, **gpus}]}))
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{PORT}")
    tc = service.create_lora_training_client(base_model="m", rank=32, seed=0, train_unembed=train_unembed).result()
    sft = [types.Datum(model_input=types.ModelInput.from_ints(p + a[:-1]), loss_fn_inputs={
        "target_tokens": (p + a)[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)}) for p, a in pairs]
    times: dict[str, list[float]] = {"sft": [], "rl": [], "rl_sampling": []}
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        tc.forward_backward(sft, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        times["sft"].append(time.perf_counter() - t0)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        results = [f.result() for f in futures]
        times["rl_sampling"].append(time.perf_counter() - t0)
        rl = []
        for p, res in zip(prompts, results):
            for s in res.sequences:
                seq = p + list(s.tokens)
                rl.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
                    "target_tokens": seq[1:], "logprobs": [0.0] * (len(p) - 1) + list(s.logprobs),
                    "advantages": [0.0] * (len(p) - 1) + [0.5] * len(s.tokens)}))
        tc.forward_backward(rl, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        times["rl"].append(time.perf_counter() - t0)
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    actor = ray.get_actor(NAME, namespace=NAMESPACE)
    times["prompts_per_sample_call"] = ray.get(actor.sample_calls.remote())
    times["prompts_by_engine"] = ray.get(actor.sample_engines.remote())
    service.close("success").result()
    from ray import serve

    serve.shutdown()
    ray.kill(actor)
    ray.shutdown()
    return times


def workload(name: str, extra=None):
    """The command line both Tinker benchmarks take (``extra`` adds to it), and the workload it
    names: ``(args, model path, SFT pairs, RL prompts)``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", default="100m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-wait-ms", type=float, default=30.0, help="the service's sample_batch_wait_ms")
    ap.add_argument("--tmp", default=f"/tmp/otray-{name.replace('_', '-')}-bench")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{name}.json"))
    if extra:
        extra(ap)
    args = ap.parse_args()

    from otray.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(f"tiny-{args.shape}", ROOT / ".cache" / "models")
    tok = load_tokenizer(path)
    return args, path, data(tok, args.batch, 0), [p for p, _ in data(tok, args.prompts, 1)]


def main() -> None:
    args, path, pairs, prompts = workload("tinker_api")
    local = in_process(path, args, pairs, prompts)
    remote = through_sdk(path, args, pairs, prompts)
    rows = {}
    print(f"{'step':6} {'in-process s':>13} {'SDK over HTTP s':>16} {'overhead':>9}")
    for kind in ("sft", "rl", "rl_sampling"):
        a, b = statistics.median(local[kind][1:]), statistics.median(remote[kind][1:])
        rows[kind] = {"in_process_s": a, "sdk_s": b, "overhead": (b - a) / a,
                      "in_process_all_s": local[kind], "sdk_all_s": remote[kind]}
        print(f"{kind:6} {a:13.3f} {b:16.3f} {100 * (b - a) / a:8.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print(f"prompts per learner sample call (SDK side): {remote['prompts_per_sample_call']}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "model": f"tiny-{args.shape}", "threads": THREADS,
                                          "prompts_per_sample_call": remote["prompts_per_sample_call"],
                                          "target_overhead": 0.15, "results": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
