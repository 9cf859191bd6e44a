"""Serve overhead: the OpenAI-compatible app over HTTP vs. the backend called in-process.

The same chat requests (tiny model, greedy, ``max_tokens`` 16) at 1, 8 and 32 concurrent
clients, two ways, alternating per concurrency level:

- in-process: threads that tokenize with the chat template, call the HF backend's
  ``generate`` (one call at a time, as a replica runs them) and decode;
- over HTTP: threads with their own ``httpx`` client posting ``/v1/chat/completions`` to
  the Serve app (one ModelServer replica with the same torch threads).

Reports requests/s and p50/p99 latency for each and the p50 overhead (HTTP / in-process
- 1; target <= 30% at concurrency 8); saves ``benchmarks/results/serve.json``.

    python benchmarks/serve.py [--requests 64] [--port 8471]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--port", type=int, default=8471)
    args = ap.parse_args()

    import httpx
    import ray
    import torch
    from ray import serve

    from otray import config
    from otray.actors.backends.hf import HFBackend
    from otray.models import chat_prompt_ids, load_tokenizer, resolve_model_path
    from otray.serve.app import run
    from otray.types import SamplingParams

    tiny = resolve_model_path("tiny")
    torch.set_num_threads(THREADS)
    tok, backend, lock = load_tokenizer(tiny), HFBackend(tiny, max_model_len=512), threading.Lock()
    params = SamplingParams(max_tokens=16, temperature=0.0)

    def in_process(i: int) -> None:
        ids = chat_prompt_ids(tok, messages(i))
        with lock:
            sample = backend.generate([ids], params, 1)[0][0]
        tok.decode(sample.token_ids, skip_special_tokens=True)

    ray.init(num_cpus=THREADS + 1, include_dashboard=False, log_to_driver=False)
    cfg = config.load_serve({"port": args.port, "models": [{"name": "tiny", "path": tiny, "num_threads": THREADS,
                                                            "replica_cpus": 1, "max_ongoing_requests": 64}]})
    run(cfg)
    local = threading.local()

    def over_http(i: int) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120)
        r = local.client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages(i),
                                                             "max_tokens": 16, "temperature": 0})
        r.raise_for_status()

    for call in (in_process, over_http):  # warm-up
        measure(call, 4, 8)
    rows = []
    try:
        for concurrency in (1, 8, 32):
            direct = measure(in_process, concurrency, args.requests)
            http = measure(over_http, concurrency, args.requests)
            rows.append({"concurrency": concurrency, "in_process": direct, "http": http,
                         "p50_overhead": http["p50_s"] / direct["p50_s"] - 1,
                         "throughput_ratio": http["requests_per_s"] / direct["requests_per_s"]})
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{'clients':>7} {'in-proc req/s':>13} {'http req/s':>10} {'in-proc p50':>11} {'http p50':>9} "
          f"{'http p99':>9} {'p50 overhead':>12}")
    for r in rows:
        print(f"{r['concurrency']:7d} {r['in_process']['requests_per_s']:13.1f} {r['http']['requests_per_s']:10.1f} "
              f"{r['in_process']['p50_s'] * 1000:9.1f}ms {r['http']['p50_s'] * 1000:7.1f}ms "
              f"{r['http']['p99_s'] * 1000:7.1f}ms {r['p50_overhead']:12.1%}")
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args),
           "model": "tiny (HF backend, greedy, max_tokens 16)", "rows": rows, "target_p50_overhead_at_8": 0.30}
    (RESULTS / "serve.json").write_text(json.dumps(out, indent=1))
    print(f"saved {RESULTS / 'serve.json'}")


if __name__ == "__main__":
    main()
