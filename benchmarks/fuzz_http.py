"""Fuzz every HTTP route of the Serve app: no response >= 500, no hang.

Routes come from the app's own OpenAPI schema (``/openapi.json``); for each, requests are
generated from it and from what the handlers read (the OpenAI request fields): every declared
path and query parameter filled with hostile values (huge and negative integers, 5,000-digit
numbers, unicode, ``../``, empty), JSON bodies with each OpenAI field set to a value of the wrong
type or out of range, fields unknown, deep nesting, raw garbage, truncated JSON, wrong content
types and methods, and each request with no key, a wrong key, another user's key or the right
one. Every response is checked: status < 500, an answer within ``--timeout`` seconds, and a 4xx
body in OpenAI's error shape. Prints the counts by status and saves
``benchmarks/results/fuzz_http.json``.

    python benchmarks/fuzz_http.py [--requests 1200] [--port 8479] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_cluster import start, stop  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
          "stream_options", "logprobs", "user", "presence_penalty", "tools"]
HOSTILE = [None, True, -1, 0, 2**63, -2**63, 10**30, 1.5, float("1e308"), "", "x" * 10_000, "\u202e\u0000\ud7ff",
           "../../etc/passwd", [], [None], {}, {"a": {"b": {"c": []}}}, "NaN", "job-20990101-000000-abcdef",
           [{"role": "user"}], [{"role": "system", "content": 5}], [{"role": "tool", "content": "x" * 3000}]]
PATH_VALUES = ["20990101-000000-abcdef", "x" * 300, "..%2F..%2Fetc", "%00", "9" * 40, "-1", "\u00e9\u00e8", "job"]
QUERY_VALUES = ["99999999999999999999", "-5", "1.5", "", "nan", "9" * 5000, "0", "abc"]


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def bodies(rng: random.Random, served: Any) -> bytes | None:
    """One hostile body for a POST route."""
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # garbage
    if kind == 1:
        return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()[:-rng.randrange(1, 10)]
    if kind == 2:
        return deep(rng.choice([100, 999, 1000, 5000]))
    if kind == 3:
        return b'{"model": "tiny", "prompt": "1+1=", "max_tokens": ' + b"9" * rng.choice([20, 5000]) + b"}"
    body: dict[str, Any] = {"model": rng.choice(["tiny", f"job-{served.job}", "nope"]),
                            "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 4}
    if rng.random() < 0.5:
        body = {"model": body["model"], "prompt": "2+2=", "max_tokens": 4}
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(FIELDS + ["unknown_field"])] = rng.choice(HOSTILE)
    return json.dumps(body, allow_nan=True).encode()


def requests_for(schema: dict[str, Any], rng: random.Random, served: Any, n: int) -> list[dict[str, Any]]:
    keys = [None, "otr_1_wrong", "garbage"] + [served.bob, served.alice, served.admin] * 3  # mostly past auth
    routes = [(path, method, op) for path, ops in schema["paths"].items() for method, op in ops.items()]
    out = []
    for i in range(n):
        path, method, op = routes[i % len(routes)]
        url = path
        for p in op.get("parameters", []):
            if p["in"] == "path":
                value = rng.choice(PATH_VALUES + [served.job, "app.js", "style.css"])
                url = url.replace("{" + p["name"] + "}", value)
        query = {p["name"]: rng.choice(QUERY_VALUES) for p in op.get("parameters", []) if p["in"] == "query"
                 and rng.random() < 0.7}
        if rng.random() < 0.1:
            method = rng.choice(["get", "post", "delete", "put", "patch"])  # the wrong method
        body = bodies(rng, served) if method in ("post", "put", "patch") else None
        headers = {"content-type": rng.choice(["application/json", "text/plain", "application/x-www-form-urlencoded"])}
        key = rng.choice(keys)
        if key is not None:
            headers["authorization"] = f"Bearer {key}" if rng.random() < 0.85 else rng.choice([key, f"Basic {key}"])
        out.append({"method": method.upper(), "url": url, "params": query, "content": body, "headers": headers})
    return out


def main() -> int:
    import httpx

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--port", type=int, default=8479)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    served = start(args.port)
    try:
        schema = httpx.get(f"{served.url}/openapi.json", timeout=30).json()
        reqs = requests_for(schema, random.Random(args.seed), served, args.requests)
        statuses: Counter[str] = Counter()
        bad: list[dict[str, Any]] = []
        t0 = time.time()
        with httpx.Client(base_url=served.url, timeout=args.timeout) as client:
            for r in reqs:
                try:
                    resp = client.request(r["method"], r["url"], params=r["params"], content=r["content"],
                                          headers=r["headers"])
                except httpx.TimeoutException:
                    statuses["hang"] += 1
                    bad.append({**r, "content": repr(r["content"])[:300], "status": "hang"})
                    continue
                statuses[str(resp.status_code)] += 1
                shaped = resp.status_code < 400 or "error" in json_body(resp)
                if resp.status_code >= 500 or not shaped:
                    bad.append({"method": r["method"], "url": r["url"], "params": r["params"],
                                "content": repr(r["content"])[:300], "status": resp.status_code,
                                "body": resp.text[:300]})
        elapsed = time.time() - t0
    finally:
        stop()
    routes = sorted({f"{m.upper()} {p}" for p, ops in schema["paths"].items() for m in ops})
    over_500 = sum(v for k, v in statuses.items() if k != "hang" and int(k) >= 500)
    result = {"requests": len(reqs), "routes": routes, "by_status": dict(sorted(statuses.items())),
              "responses_5xx": over_500, "hangs": statuses.get("hang", 0), "not_openai_shaped_4xx":
              sum(1 for b in bad if isinstance(b["status"], int) and 400 <= b["status"] < 500),
              "examples_of_failures": bad[:20], "seconds": round(elapsed, 1), "seed": args.seed,
              "target": "0 responses >= 500, 0 hangs, every 4xx in OpenAI's error shape"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fuzz_http.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "examples_of_failures"}, indent=1))
    for b in bad[:10]:
        print("FAILED:", json.dumps(b)[:400])
    return 0 if not bad else 1


def json_body(resp: Any) -> dict[str, Any]:
    """A response's JSON object, or {} when it is not one."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


if __name__ == "__main__":
    sys.exit(main())
