"""A local cluster for the HTTP benchmarks (fuzz_http.py, soak.py): Ray, a ResourceManager with
auth on (an admin and two users, in a temporary registry), one finished job of alice's with a
checkpoint, and the Serve app on ``port``. ``start()`` returns what the scripts need; ``stop()``
takes it all down."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Served:
    url: str
    admin: str
    alice: str
    bob: str
    job: str  # alice's finished job, with a checkpoint: model "job-<id>"


def start(port: int) -> Served:
    import ray

    from otray import config
    from otray.actors.control.resource_manager import get_or_create
    from otray.models import resolve_model_path
    from otray.serve import config as serve_config
    from otray.serve.app import run

    tmp = Path(tempfile.mkdtemp(prefix="otray-bench-serve-"))
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, namespace="otray",
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    rm = get_or_create(str(tmp / "registry.db"), auth_enabled=True)
    admin = ray.get(rm.add_user.remote("admin"))
    alice, bob = (ray.get(rm.add_user.remote(n, False, admin)) for n in ("alice", "bob"))
    job_cfg = config.to_dict(config.load(ROOT / "conf" / "arithmetic_grpo.yaml", [
        "sft.steps=20", "sft.stop_at_accuracy=null", "algo.steps=1", "algo.batch_size=2", "eval.num_samples=2"]))
    for key in ("job", "model"):  # a user's config: the cluster chooses the output dir and model cache
        job_cfg[key].pop("output_dir" if key == "job" else "cache_dir", None)
    job = ray.get(rm.submit.remote(job_cfg, alice))
    deadline = time.time() + 600
    while not (st := ray.get(rm.status.remote(job, alice))).terminal:
        assert time.time() < deadline, "the setup job did not finish"
        time.sleep(1)
    assert st.succeeded, st
    tiny = resolve_model_path("tiny", ROOT / ".cache" / "models")
    run(serve_config.load_serve({"port": port, "request_timeout_s": 60, "max_n": 4, "max_tokens": 64,
                                 "models": [{"name": "tiny", "path": tiny}]}))
    return Served(f"http://127.0.0.1:{port}", admin, alice, bob, job)


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def gateway_pid() -> int:
    """The Gateway replica's process (for its memory)."""
    import ray

    table = ray._private.state.actors().values()
    pids = [a["Pid"] for a in table if a["State"] == "ALIVE" and "Gateway" in a["ActorClassName"]]
    assert len(pids) == 1, pids
    return pids[0]
