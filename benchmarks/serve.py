"""Serve overhead: the OpenAI-compatible app over HTTP vs. the backend called in-process.

The same chat requests (tiny model, greedy, ``max_tokens`` 16) at 1, 8 and 32 concurrent
clients, three ways, alternating per concurrency level:

- in-process, one at a time: threads that tokenize with the chat template, call the HF
  backend's ``generate`` under a lock (the backend runs one call at a time) and decode;
- in-process, batched: the same threads through ``Loaded``, the replica's dynamic
  batcher (concurrent requests with equal settings share one ``generate`` call);
- over HTTP: threads with their own ``httpx`` client posting ``/v1/chat/completions`` to
  the Serve app (``--layout``: by default the one replica that routes and generates,
  ``split`` a Gateway in front of a ModelServer replica; the same torch threads, the same
  batcher).

Each concurrency level is measured ``--rounds`` times (the three ways in turn each round);
reports the median over rounds of requests/s and p50/p99 latency for each way, and the
p50 overhead of HTTP against the batched way per round and its median (HTTP / batched - 1;
target <= 30% at concurrency 8: the batched way runs the same generate calls); saves
``benchmarks/results/serve.json``.

    python benchmarks/serve.py [--requests 64] [--rounds 3] [--port 8471] [--layout auto|single|split]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {i % 90 + 10}+{(7 * i) % 90 + 10}?"}]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(call, concurrency: int, n: int) -> dict[str, float]:
    latencies: list[float] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        call(i)
        latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    return {"requests_per_s": n / wall, "p50_s": statistics.median(latencies), "p99_s": percentile(latencies, 0.99)}


def summarize(concurrency: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency level over all rounds: the median of each figure, and each round's overhead."""
    def med(way: str) -> dict[str, float]:
        return {k: statistics.median(r[way][k] for r in rounds) for k in rounds[0][way]}

    a, b, h = med("in_process"), med("in_process_batched"), med("http")
    overheads = [r["p50_overhead"] for r in rounds]
    return {"concurrency": concurrency, "in_process": a, "in_process_batched": b, "http": h,
            "p50_overhead": statistics.median(overheads), "p50_overhead_rounds": overheads,
            "p50_overhead_vs_one_at_a_time": h["p50_s"] / a["p50_s"] - 1,
            "throughput_ratio": h["requests_per_s"] / b["requests_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64, help="requests per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="each concurrency level is measured this many times, "
                                                           "the three ways in turn; figures are medians over rounds")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--batch-wait-ms", type=float, default=50.0, help="the replica's batch_wait_ms (serve config default 50)")
    ap.add_argument("--layout", choices=("auto", "single", "split"), default="auto",
                    help="the serve config's layout (auto = single here: one base model)")
    args = ap.parse_args()

    import httpx
    import ray
    import torch
    from ray import serve

    from otray.serve import config as serve_config
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import chat_prompt_ids, load_tokenizer, resolve_model_path
    from otray.serve.app import run
    from otray.serve.batching import Loaded
    from otray.types import SamplingParams

    tiny = resolve_model_path("tiny")
    torch.set_num_threads(THREADS)
    tok, backend, lock = load_tokenizer(tiny), HFBackend(tiny, max_model_len=512), threading.Lock()
    params = SamplingParams(max_tokens=16, temperature=0.0)

    batcher = Loaded(backend, "tiny", batch_wait_ms=args.batch_wait_ms)  # the replica's batcher, same settings

    def in_process(i: int) -> None:
        ids = chat_prompt_ids(tok, messages(i))
        with lock:
            sample = backend.generate([ids], params, 1)[0][0]
        tok.decode(sample.token_ids, skip_special_tokens=True)

    def in_process_batched(i: int) -> None:
        sample = batcher.generate([chat_prompt_ids(tok, messages(i))], params, 1)[0][0]
        tok.decode(sample.token_ids, skip_special_tokens=True)

    ray.init(address="local", num_cpus=THREADS + 1, include_dashboard=False, log_to_driver=False)
    cfg = serve_config.load_serve({"port": args.port, "models": [{"name": "tiny", "path": tiny, "num_threads": THREADS,
                                                            "replica_cpus": 1, "max_ongoing_requests": 64,
                                                            "batch_wait_ms": args.batch_wait_ms}],
                            "layout": args.layout})
    run(cfg)
    gateway = serve.get_deployment_handle("Gateway", app_name="otray")

    def replica_calls() -> int:
        return gateway.model_info.remote("tiny").result().calls
    local = threading.local()

    def over_http(i: int) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120)
        r = local.client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages(i),
                                                             "max_tokens": 16, "temperature": 0})
        r.raise_for_status()

    for call in (in_process, in_process_batched, over_http):  # warm-up
        measure(call, 4, 8)
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in (1, 8, 32)}
    try:
        for _ in range(args.rounds):  # rounds: this VM's noise moves one cell 2x between runs
            for concurrency in runs:
                direct = measure(in_process, concurrency, args.requests)
                calls = batcher.calls
                batched = measure(in_process_batched, concurrency, args.requests)
                batched["prompts_per_call"] = args.requests / (batcher.calls - calls)
                calls = replica_calls()
                http = measure(over_http, concurrency, args.requests)
                http["prompts_per_call"] = args.requests / (replica_calls() - calls)
                runs[concurrency].append({"in_process": direct, "in_process_batched": batched, "http": http,
                                          "p50_overhead": http["p50_s"] / batched["p50_s"] - 1})
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = [summarize(concurrency, r) for concurrency, r in runs.items()]
    print(f"{'clients':>7} {'req/s: one-at-a-time':>20} {'batched':>8} {'http':>6}   "
          f"{'p50: one-at-a-time':>18} {'batched':>8} {'http':>8} {'http p99':>9}   "
          f"{'prompts/call: batched':>21} {'http':>5}   {'p50 overhead vs batched: median (each round)':>44}")
    for r in rows:
        a, b, h = r["in_process"], r["in_process_batched"], r["http"]
        each = " ".join(f"{x:.0%}" for x in r["p50_overhead_rounds"])
        print(f"{r['concurrency']:7d} {a['requests_per_s']:20.1f} {b['requests_per_s']:8.1f} {h['requests_per_s']:6.1f}   "
              f"{a['p50_s'] * 1000:16.1f}ms {b['p50_s'] * 1000:6.1f}ms {h['p50_s'] * 1000:6.1f}ms "
              f"{h['p99_s'] * 1000:7.1f}ms   {b['prompts_per_call']:21.1f} {h['prompts_per_call']:5.1f}   "
              f"{r['p50_overhead']:10.1%} ({each})")
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args),
           "model": "tiny (HF backend, greedy, max_tokens 16)", "rows": rows, "target_p50_overhead_at_8": 0.30}
    (RESULTS / "serve.json").write_text(json.dumps(out, indent=1))
    print(f"saved {RESULTS / 'serve.json'}")


if __name__ == "__main__":
    main()
