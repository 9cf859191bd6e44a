"""RolloutWorker (one backend behind one interface) and RolloutFleet (its manager).

``RolloutWorker`` is a plain class; jobs wrap it with ``ray.remote``. It owns a
backend (``vllm``, ``hf``, or ``auto`` = vLLM when it imports, else HF) and the
policy version of the weights it holds.

``RolloutFleet`` is the driver-side manager of N worker actors: it splits a batch
of prompts over the live workers, health-checks them, routes around a worker that
died (re-running its share on the others) and reports which one failed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from otray.actors import current_node_id
from otray.timing import BusyClock
from otray.types import ConfigError, GenerateResult, RolloutError, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)
BACKENDS = ("auto", "vllm", "hf")


def make_backend(name: str, model_path: str, **kwargs: Any):
    if name not in BACKENDS:
        raise ConfigError(f"unknown rollout backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        from otray.actors.backends.vllm import vllm_available

        name = "vllm" if vllm_available() else "hf"
    if name == "vllm":
        from otray.actors.backends.vllm import VLLMBackend

        return VLLMBackend(model_path, **kwargs)
    from otray.actors.backends.hf import HFBackend

    return HFBackend(model_path, **kwargs)


class RolloutWorker:
    def __init__(self, model_path: str, backend: str = "auto", *, num_threads: int | None = None, **backend_kwargs: Any):
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
            os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
        self.backend = make_backend(backend, model_path, **backend_kwargs)
        self.version = 0
        self.busy = BusyClock()  # seconds spent generating or loading weights

    def ping(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        return {"backend": self.backend.name, "max_model_len": self.backend.max_model_len,
                "stop_token_ids": list(self.backend.stop_token_ids), "policy_version": self.version,
                "node_id": current_node_id()}

    def busy_s(self) -> float:
        return self.busy.total

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[GenerateResult]:
        with self.busy():
            samples = self.backend.generate(prompts, params, n)
        return [GenerateResult(s, self.version) for s in samples]

    def update_weights(self, update: WeightUpdate) -> int:
        """Load new weights (full or LoRA); returns the worker's new policy version."""
        with self.busy():
            return self._update_weights(update)

    def _update_weights(self, update: WeightUpdate) -> int:
        if update.kind == "full":
            self.backend.load_full_weights(update.tensors)
        elif update.kind == "lora":
            self.backend.load_lora(update.tensors, update.lora_config or {}, update.version)
        else:
            raise ValueError(f"unknown weight update kind {update.kind!r} (expected 'full' or 'lora')")
        self.version = update.version
        return self.version

    def policy_version(self) -> int:
        return self.version

    def shutdown(self) -> None:
        stop = getattr(self.backend, "shutdown", None)
        if stop is not None:
            stop()


class RolloutFleet:
    """Driver-side manager of rollout worker actors."""

    def __init__(self, workers: list[Any]):
        if not workers:
            raise ConfigError("a rollout fleet needs at least one worker (rollout.num_workers >= 1)")
        self.workers = list(workers)
        self.dead: dict[int, str] = {}  # worker index -> why it was dropped

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.workers)) if i not in self.dead]

    def health_check(self, timeout: float = 30.0) -> dict[int, bool]:
        import ray

        refs = {i: self.workers[i].ping.remote() for i in self.live}
        status = {}
        for i, ref in refs.items():
            try:
                status[i] = bool(ray.get(ref, timeout=timeout))
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                self._drop(i, e)
                status[i] = False
        return status

    def _drop(self, i: int, err: BaseException) -> None:
        first_line = (str(err).strip().splitlines() or [""])[0]
        self.dead[i] = f"{type(err).__name__}: {first_line}"[:300]
        log.warning("rollout worker %d dropped: %s", i, err)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[GenerateResult]:
        """Split ``prompts`` over live workers; a failed share is re-run on the others."""
        import ray

        results: list[GenerateResult | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            live = self.live
            if not live:
                raise RolloutError("every rollout worker failed: " +
                                   "; ".join(f"worker {i}: {why}" for i, why in self.dead.items()))
            shares = {w: pending[k::len(live)] for k, w in enumerate(live)}
            refs = {w: self.workers[w].generate.remote([prompts[j] for j in idx], params, n)
                    for w, idx in shares.items() if idx}
            pending = []
            for w, ref in refs.items():
                try:
                    for j, r in zip(shares[w], ray.get(ref)):
                        results[j] = r
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    self._drop(w, e)
                    pending.extend(shares[w])
        return results  # type: ignore[return-value]

    def busy_s(self) -> list[float]:
        """Each live worker's busy seconds so far (see ``otray.timing.BusyClock``)."""
        import ray

        return ray.get([self.workers[i].busy_s.remote() for i in self.live])

    def update_weights(self, update_ref: Any) -> list[int]:
        """Push one weight update (an ObjectRef, so it travels via the object store) to every live worker."""
        import ray

        refs = {i: self.workers[i].update_weights.remote(update_ref) for i in self.live}
        versions = []
        for i, ref in refs.items():
            try:
                versions.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self._drop(i, e)
        if not versions:
            raise RolloutError("no rollout worker accepted the weight update")
        return versions


def wait_ready(handles: list[Any], timeout: float = 600.0) -> float:
    """Block until every actor answers ``ping``; returns seconds waited."""
    import ray

    t0 = time.perf_counter()
    ray.get([h.ping.remote() for h in handles], timeout=timeout)
    return time.perf_counter() - t0
