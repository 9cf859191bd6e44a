"""Driver-side API: connect to a cluster, submit jobs, follow them.

    client = otray.connect()                      # RAY_ADDRESS / a local Ray
    job = client.submit("conf/arithmetic_grpo.yaml", overrides=["algo.steps=10"])
    job.wait()                                    # -> final status dict
    job.metrics()                                 # -> list of metrics rows

Configs are validated here, before anything reaches the cluster, so a bad key
fails at submit with the key named.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from otray import config as config_mod
from otray.types import LossNormalizer, OtrayError

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class JobFailedError(OtrayError, RuntimeError):
    """``JobHandle.wait(raise_on_failure=True)`` on a job that did not succeed."""


class JobHandle:
    def __init__(self, client: Client, job_id: str):
        self.client, self.id = client, job_id

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.client.rm, method).remote(*args, api_key=self.client.api_key))

    def status(self) -> dict[str, Any]:
        return self._call("status", self.id)

    def metrics(self, since: int = 0) -> list[dict[str, Any]]:
        return self._call("metrics", self.id, since)

    def cancel(self) -> dict[str, Any]:
        return self._call("cancel", self.id)

    def outputs(self, page: int = 1000) -> list[dict[str, Any]]:
        """An inference job's output rows (one per episode or game), fetched through Ray from any node."""
        rows: list[dict[str, Any]] = []
        while True:
            got = self._call("outputs", self.id, len(rows), page)
            rows.extend(got)
            if len(got) < page:
                return rows

    def download_checkpoint(self, dest: str | Path, step: int | None = None) -> Path:
        """Fetch the job's checkpoint at ``step`` (default: latest) through Ray into ``dest``:
        ``dest/state`` (learner state) and ``dest/model`` (HF/PEFT model)."""
        from otray.actors.checkpoint_store import unpack_dir

        _, blob = self._call("checkpoint_blob", self.id, step)
        return unpack_dir(blob, dest)

    def wait(self, timeout: float | None = None, poll_s: float = 0.5, raise_on_failure: bool = False) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status()
            if st["state"] in TERMINAL:
                if raise_on_failure and st["state"] != "SUCCEEDED":
                    raise JobFailedError(f"job {self.id} ended {st['state']}: {st['error']}")
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} still {st['state']} after {timeout} s")
            time.sleep(poll_s)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"


class TrainingClient:
    """Tinker-style primitives on a PolicyLearner actor, for custom training loops.

    Each call blocks and returns the learner's result; ``self.learner`` is the actor
    handle for callers who want futures (``tc.learner.forward_backward.remote(...)``).
    """

    def __init__(self, model_path: str, *, lora_rank: int = 0, num_cpus: float = 1, **learner_kwargs: Any):
        import ray

        from otray.actors.learner import PolicyLearner

        self.model_path = model_path
        lora = {"rank": lora_rank, **learner_kwargs.pop("lora", {})}
        self.learner = ray.remote(num_cpus=num_cpus)(PolicyLearner).remote(model_path, lora=lora, **learner_kwargs)

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref)

    def forward(self, datums: list) -> list[list[float]]:
        return self._get(self.learner.forward.remote(datums))

    def forward_backward(self, datums: list, loss_fn: str, loss_fn_config: dict[str, float] | None = None,
                         aggregation: str = "token_mean", normalizer: LossNormalizer | None = None) -> dict[str, float]:
        return self._get(self.learner.forward_backward.remote(datums, loss_fn, loss_fn_config, aggregation, normalizer))

    def optim_step(self, learning_rate: float = 1e-4, **adam: Any) -> dict[str, float]:
        return self._get(self.learner.optim_step.remote(learning_rate, **adam))

    def save_state(self, path: str) -> str:
        return self._get(self.learner.save_state.remote(path))

    def load_state(self, path: str) -> dict[str, Any]:
        return self._get(self.learner.load_state.remote(path))

    def sampling_client(self, backend: str = "hf", **worker_kwargs: Any) -> SamplingClient:
        """A rollout worker holding this learner's *current* weights (sent via the object store)."""
        client = SamplingClient(self.model_path, backend, **worker_kwargs)
        client.update(self.learner.weights.remote())
        return client


class SamplingClient:
    """Sampling on a RolloutWorker actor: ``sample(prompt_ids, params, n)``."""

    def __init__(self, model_path: str, backend: str = "hf", *, num_cpus: float = 1, **worker_kwargs: Any):
        import ray

        from otray.actors.rollout import RolloutWorker

        self.worker = ray.remote(num_cpus=num_cpus)(RolloutWorker).remote(model_path, backend, **worker_kwargs)

    def update(self, weights_ref: Any) -> int:
        import ray

        return ray.get(self.worker.update_weights.remote(weights_ref))

    def sample(self, prompt_ids: list[list[int]], params: Any, n: int = 1) -> list:
        import ray

        return ray.get(self.worker.generate.remote(prompt_ids, params, n))


class Client:
    def __init__(self, rm: Any, api_key: str | None):
        self.rm, self.api_key = rm, api_key

    def training_client(self, model: str = "tiny", *, lora_rank: int = 0, **kwargs: Any) -> TrainingClient:
        """A learner actor for a custom loop; ``model`` is a path, hub id or ``tiny``."""
        from otray.models import resolve_model_path

        return TrainingClient(resolve_model_path(model), lora_rank=lora_rank, **kwargs)

    def submit(self, config: str | Path | dict[str, Any] | config_mod.Config,
               overrides: list[str] | None = None) -> JobHandle:
        import ray

        cfg = config_mod.load(config, overrides)
        # an admin's relative job.output_dir counts from here, not from wherever the job lands
        job_id = ray.get(self.rm.submit.remote(config_mod.to_dict(cfg), api_key=self.api_key, cwd=os.getcwd()))
        return JobHandle(self, job_id)

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id)

    def jobs(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.rm.jobs.remote(api_key=self.api_key))

    def add_user(self, name: str, admin: bool = False) -> str:
        import ray

        return ray.get(self.rm.add_user.remote(name, admin, api_key=self.api_key))


def connect(address: str | None = None, api_key: str | None = None, *, db_path: str | None = None,
            auth_enabled: bool | None = None) -> Client:
    """Join the Ray cluster at ``address`` (default ``RAY_ADDRESS``, else start a local one)
    and find or start its ResourceManager."""
    import ray

    from otray.actors.resource_manager import get_or_create

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                 namespace="otray",
                 runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                                           "TOKENIZERS_PARALLELISM": "false"}})
    if auth_enabled is None:
        auth_enabled = os.environ.get("OTRAY_AUTH", "0") == "1"
    rm = get_or_create(db_path, auth_enabled=auth_enabled)  # db_path None: $OTRAY_DB or <otray home>/registry.db
    ray.get(rm.ping.remote())
    return Client(rm, api_key if api_key is not None else os.environ.get("OTRAY_API_KEY"))
