"""Fuzz every route of ``otray tinker`` (the Tinker API): no response >= 500, no hang.

The service runs with auth on and two users on a local Ray (the tiny model, sampled by its learner).
Alice first makes real ids with the ``tinker`` SDK (a session, a training run, a sampler checkpoint,
a sampling session), so hostile requests reach the code behind the checks, not only the checks.
Routes come from the app's own ``/openapi.json``. Each request takes a route, fills its path
parameters with hostile or real ids, and sends one of: a JSON body with the fields the service reads
(``model_id``, ``seq_id``, ``num_samples``, ``sampling_params``, ``prompt``, ``tinker_path``, ...) each
set to a value of the wrong type or out of range (lists, dicts, 5,000-digit and 2**70 integers,
NaN, unicode, ``../``), fields unknown, 100,000-deep JSON, truncated JSON, protobuf garbage, the
wrong method or content type; with no key, a wrong key, bob's key (another user) or alice's.
Every response is checked: status < 500, an answer within ``--timeout`` seconds, a 4xx body with a
``detail``. Prints the counts by status and saves ``benchmarks/results/fuzz_tinker.json``.

    python benchmarks/fuzz_tinker.py [--requests 1500] [--port 8491] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fuzz_http import json_body  # noqa: E402
from benchmarks.results_io import save  # noqa: E402

BASE = "tiny"
PREFIX = "/api/v1"  # otray.tinker.gateway.app.ROUTE_PREFIX: the schema's paths are under it
FIELDS = ["model_id", "seq_id", "session_id", "base_model", "lora_config", "num_samples", "sampling_params",
          "prompt", "tinker_path", "path", "request_id", "model_path", "sampling_session_id", "adam_params",
          "prompt_logprobs", "prompt_logprobs_last_n", "ttl_seconds", "user_metadata", "name", "type",
          "sampling_session_seq_id", "optimizer", "loss_fn", "overwrite", "tags", "sdk_version",
          "custom_loss_seq_id", "graph", "inputs", "source_path", "destination_project_id"]
HOSTILE = [None, True, -1, 0, 2**70, -2**63, 10**30, 1.5, float("nan"), float("1e308"), "", "x" * 10_000,
           "\u202e\u0000\ud7ff", "../../etc/passwd", "tinker://../../x", "tinker://s-nope:train:0/weights/x",
           [], [None], [1, 2], {}, {"a": {"b": []}}, {"chunks": [{"tokens": [10**12, -5]}]},
           {"chunks": [{"tokens": ["a"]}]}, {"chunks": "x"}, {"max_tokens": "abc"}, {"max_tokens": 10**9},
           {"stop": [1.5, None]}, {"temperature": "hot"}, {"rank": 10**6}, {"learning_rate": "fast"},
           # custom loss graphs and inputs (create_custom_loss): forbidden ops, malformed nodes and encodings
           {"nodes": [{"op": "call_function", "name": "x", "target": "os.system", "args": ["ls"]}]},
           {"nodes": [None, 5, "x"]}, {"nodes": "x"}, {"format": 2, "nodes": []},
           {"nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                      {"op": "call_function", "name": "y", "target": "torch.exp", "args": [{"ref": 5}, {"slice": [1]},
                                                                                            {"tuple": "x"}, {"dict": []},
                                                                                            {"float": "1e999"}]},
                      {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "y"}, {}]}]}]},
           [{"name": "logprobs", "rank": 7}], [{"name": 5, "rank": 1}], [{"name": "logprobs", "rank": True}]]
PATH_VALUES = ["s-nope:train:0", "x" * 300, "..%2F..%2Fetc", "%00", "9" * 40, "-1", "\u00e9", "sampler_weights/x"]


@dataclass
class Made:
    """Real ids alice made with the SDK, so hostile requests reach past the 404s."""

    url: str
    alice: str
    bob: str
    session_id: str
    model_id: str
    sampler_path: str
    sampling_session_id: str


def start(port: int, tmp: Path) -> tuple[Made, Any]:
    """Ray, a ResourceManager with auth on, ``otray tinker`` on ``port``, and alice's real ids."""
    import ray
    import tinker

    from otray.actors.control.registry import tinker_key
    from otray.actors.control.resource_manager import get_or_create
    from otray.tinker.gateway.app import run
    from otray.tinker.config import load_tinker

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    rm = get_or_create(str(tmp / "registry.db"), auth_enabled=True)
    alice = ray.get(rm.add_user.remote("alice"))
    bob = ray.get(rm.add_user.remote("bob", False, alice))
    run(load_tinker({"port": port, "storage": str(tmp / "store"), "long_poll_s": 2,
                     "models": [{"name": BASE, "path": "tiny", "sampler": {"engine": "learner"}}]}))
    url = f"http://127.0.0.1:{port}"
    sc = tinker.ServiceClient(base_url=url, api_key=tinker_key(alice))
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    path = tc.save_weights_for_sampler(name="fuzz").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    made = Made(url, tinker_key(alice), tinker_key(bob), sc.holder.get_session_id(), tc.model_id, path,
                sampler._sampling_session_id)
    return made, sc


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def body(rng: random.Random, made: Made) -> bytes:
    """One hostile request body."""
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # garbage (or a broken protobuf)
    if kind == 1:
        return json.dumps({"model_id": made.model_id, "seq_id": 1}).encode()[:-rng.randrange(1, 8)]  # truncated
    if kind == 2:
        return b"[" * rng.choice([1000, 100_000]) + b"]" * rng.choice([0, 1000])  # deep
    if kind == 3:
        return b'{"model_id": "' + made.model_id.encode() + b'", "seq_id": ' + b"9" * rng.choice([25, 5000]) + b"}"
    real = {"model_id": made.model_id, "session_id": made.session_id, "seq_id": rng.randrange(1, 5),
            "base_model": BASE, "tinker_path": made.sampler_path, "path": made.sampler_path,
            "model_path": made.sampler_path, "sampling_session_id": made.sampling_session_id,
            "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 2}, "custom_loss_seq_id": rng.randrange(3), "source_path": made.sampler_path,
            "inputs": [{"name": "logprobs", "rank": 1}],
            "graph": {"nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                                {"op": "call_method", "name": "s", "target": "sum", "args": [{"ref": "logprobs"}]},
                                {"op": "output", "name": "output", "target": "output",
                                 "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}]}]}}
    out = {k: v for k, v in real.items() if rng.random() < 0.6}
    for _ in range(rng.randrange(1, 4)):
        out[rng.choice(FIELDS + ["unknown_field"])] = rng.choice(HOSTILE)
    return json.dumps(out, allow_nan=True).encode()


def requests_for(schema: dict[str, Any], rng: random.Random, made: Made, n: int) -> list[dict[str, Any]]:
    keys = [None, "tml-1_wrong", "garbage", made.bob] + [made.alice] * 6  # mostly past auth, as alice
    routes = [(path, method) for path, ops in schema["paths"].items() for method in ops]
    out = []
    for i in range(n):
        path, method = routes[i % len(routes)]
        real = {"session_id": made.session_id, "model_id": made.model_id,
                "sampler_id": made.sampling_session_id, "checkpoint_id": "sampler_weights/fuzz"}
        for name in [p.strip("{}").split(":")[0] for p in path.split("/") if p.startswith("{")]:
            value = real.get(name) if rng.random() < 0.4 else rng.choice(PATH_VALUES)
            path = path.replace("{" + name + "}", str(value)).replace("{" + name + ":path}", str(value))
        if rng.random() < 0.1:
            method = rng.choice(["get", "post", "delete", "put"])
        content = body(rng, made) if method in ("post", "put") else None
        ctype = "application/x-protobuf" if path.endswith("forward_backward") and rng.random() < 0.5 else \
            rng.choice(["application/json", "text/plain"])
        headers = {"content-type": ctype}
        key = rng.choice(keys)
        if key is not None:
            headers["x-api-key"] = key
        out.append({"method": method.upper(), "url": PREFIX + path, "content": content, "headers": headers})
    return out


def fuzz(made: Made, reqs: list[dict[str, Any]], timeout: float) -> tuple[Counter[str], list[dict[str, Any]]]:
    import httpx

    statuses: Counter[str] = Counter()
    bad: list[dict[str, Any]] = []
    with httpx.Client(base_url=made.url, timeout=timeout) as client:
        for r in reqs:
            shown = {"method": r["method"], "url": r["url"], "content": repr(r["content"])[:300]}
            try:
                resp = client.request(r["method"], r["url"], content=r["content"], headers=r["headers"])
            except httpx.TimeoutException:
                statuses["hang"] += 1
                bad.append({**shown, "status": "hang"})
                continue
            statuses[str(resp.status_code)] += 1
            if resp.status_code >= 500 or (resp.status_code >= 400 and "detail" not in json_body(resp)):
                bad.append({**shown, "status": resp.status_code, "body": resp.text[:300]})
    return statuses, bad


def main(argv: list[str] | None = None) -> int:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--port", type=int, default=8491)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_tinker.json"))
    args = ap.parse_args(argv)
    made, _ = start(args.port, Path(tempfile.mkdtemp(prefix="otray-fuzz-tinker-")))
    try:
        schema = httpx.get(f"{made.url}{PREFIX}/openapi.json", timeout=30).json()
        reqs = requests_for(schema, random.Random(args.seed), made, args.requests)
        t0 = time.time()
        statuses, bad = fuzz(made, reqs, args.timeout)
        elapsed = time.time() - t0
        alive = httpx.get(f"{made.url}/api/v1/healthz", timeout=30).status_code == 200
    finally:
        stop()
    routes = sorted({f"{m.upper()} {PREFIX}{p}" for p, ops in schema["paths"].items() for m in ops})
    over_500 = sum(v for k, v in statuses.items() if k != "hang" and int(k) >= 500)
    result = {"requests": len(reqs), "routes": routes, "by_status": dict(sorted(statuses.items())),
              "responses_5xx": over_500, "hangs": statuses.get("hang", 0),
              "4xx_without_detail": sum(1 for b in bad if isinstance(b["status"], int) and 400 <= b["status"] < 500),
              "service_alive_after": alive, "examples_of_failures": bad[:20], "seconds": round(elapsed, 1),
              "seed": args.seed, "target": "0 responses >= 500, 0 hangs, every 4xx with a detail"}
    save(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "examples_of_failures"}, indent=1))
    for b in bad[:10]:
        print("FAILED:", json.dumps(b)[:400])
    return 0 if not bad and alive else 1


if __name__ == "__main__":
    sys.exit(main())
