"""Soak the Serve app: 32 concurrent clients for 10 minutes, no errors, no memory growth.

Each client loops until the end: mostly short chat completions on the base model or alice's
checkpoint (greedy, 8 tokens), and sometimes ``GET /v1/models`` or ``GET /api/jobs``, with
alice's or bob's key (bob never asks for alice's checkpoint). Per minute: requests, errors,
p50/p99 latency, and the Gateway replica's resident memory (RSS). Targets: 0 errors; RSS at the
end at most 10% above minute 2 (start-up allocations done by then). Saves
``benchmarks/results/soak.json``.

    python benchmarks/soak.py [--clients 32] [--minutes 10] [--port 8478]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import percentile as pct  # noqa: E402 (benchmarks/serve.py)
from serve_cluster import gateway_pid, start, stop  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    import httpx
    import psutil

    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--port", type=int, default=8478)
    args = ap.parse_args()
    served = start(args.port)
    gateway = psutil.Process(gateway_pid())
    t0 = time.time()
    end = t0 + 60 * args.minutes
    log: list[tuple[float, float, str]] = []  # (time done, latency, "" or the error)
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        key = served.alice if i % 2 == 0 else served.bob
        auth = {"authorization": f"Bearer {key}"}
        with httpx.Client(base_url=served.url, timeout=120) as http:
            while time.time() < end:
                roll = rng.random()
                start_t = time.perf_counter()
                try:
                    if roll < 0.8:
                        model = f"job-{served.job}" if key == served.alice and rng.random() < 0.5 else "tiny"
                        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
                        r = http.post("/v1/chat/completions", headers=auth, json={
                            "model": model, "messages": [{"role": "user", "content": f"{a}+{b}="}],
                            "max_tokens": 8, "temperature": 0})
                    elif roll < 0.9:
                        r = http.get("/v1/models", headers=auth)
                    else:
                        r = http.get("/api/jobs", headers=auth)
                    err = "" if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    err = f"{type(e).__name__}: {e}"
                with lock:
                    log.append((time.time(), time.perf_counter() - start_t, err))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    rss: list[float] = []
    minute = 1
    while minute <= args.minutes:
        time.sleep(max(0.0, t0 + 60 * minute - time.time()))
        rss.append(gateway.memory_info().rss / 2**20)
        print(f"minute {minute}: {sum(1 for d, _, _ in log if d >= t0 + 60 * (minute - 1))} requests, "
              f"gateway RSS {rss[-1]:.0f} MiB", flush=True)
        minute += 1
    for t in threads:
        t.join()
    stop()
    per_minute = []
    for m in range(int(args.minutes)):
        rows = [(lat, err) for done, lat, err in log if t0 + 60 * m <= done < t0 + 60 * (m + 1)]
        lats = [lat for lat, err in rows if not err] or [float("nan")]
        per_minute.append({"minute": m + 1, "requests": len(rows), "errors": sum(1 for _, e in rows if e),
                           "p50_s": round(pct(lats, 0.5), 4), "p99_s": round(pct(lats, 0.99), 4),
                           "gateway_rss_mib": round(rss[m], 1)})
    errors = [e for _, _, e in log if e]
    growth = (rss[-1] / rss[1] - 1) if len(rss) > 1 else 0.0
    result = {"clients": args.clients, "minutes": args.minutes, "requests": len(log), "errors": len(errors),
              "error_examples": sorted(set(errors))[:10], "rss_growth_minute2_to_end": round(growth, 4),
              "p50_s": round(statistics.median(lat for _, lat, e in log if not e), 4),
              "per_minute": per_minute, "target": "0 errors; RSS growth <= 10% from minute 2 to the end"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_minute"}, indent=1))
    return 0 if not errors and growth <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
