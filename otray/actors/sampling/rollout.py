"""RolloutWorker: one sampling backend behind one interface.

``RolloutWorker`` is a plain class; jobs wrap it with ``ray.remote``. It owns a
backend (``vllm``, ``hf``, or ``auto`` = vLLM when it imports, else HF) and the
policy version of the weights it holds. Routing prompts over several workers is
:class:`otray.actors.sampling.fleet.RolloutFleet`'s job, in whichever process drives
the rollouts (the job driver's agent loop, or the ProtocolCoordinator actor).
"""

from __future__ import annotations

import os
import time
from typing import Any

from otray.placement import current_node_id
from otray.actors.sampling.backends.base import Backend
from otray.actors.sampling.transport import Receiver
from otray.timing import BusyClock
from otray.device import resolve_device, rng_state, set_rng_state
from otray.types import ConfigError, GenerateResult, SamplingParams, WeightUpdate, WorkerInfo

BACKENDS = ("auto", "vllm", "hf")


def make_backend(name: str, model_path: str, **kwargs: Any) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"unknown rollout backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        from otray.actors.sampling.backends.vllm import vllm_available

        name = "vllm" if vllm_available() else "hf"
    if name == "vllm":
        from otray.actors.sampling.backends.vllm import VLLMBackend

        return VLLMBackend(model_path, **kwargs)
    from otray.actors.sampling.backends.hf import HFBackend

    return HFBackend(model_path, **kwargs)


class RolloutWorker:
    """One sampling backend as a Ray actor in its own bundle: generates for the job's fleet, takes weight
    updates over ``rollout.weight_sync`` (checked against their checksum) and keeps the policy version."""

    def __init__(self, model_path: str, backend: str = "auto", *, num_threads: int | None = None, **backend_kwargs: Any):
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
            os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
        self.backend: Backend = make_backend(backend, model_path, **backend_kwargs)
        self.device = resolve_device(backend_kwargs.get("device", "auto"))
        self.receiver = Receiver(self.device)  # an update's tensors, over whichever transport
        self.version = 0
        self.busy = BusyClock()  # seconds spent generating or loading weights

    def ping(self) -> bool:
        return True

    def info(self) -> WorkerInfo:
        # (device_transport imports torch: imported where used, so that a process holding only a worker's
        # handle, such as a game's coordinator, does not import torch to unpickle it)
        from otray.actors.sampling.device_transport import device_id

        return WorkerInfo(self.backend.name, self.backend.max_model_len, tuple(self.backend.stop_token_ids),
                          self.version, current_node_id(), sampler=getattr(self.backend, "sampler", self.backend.name),
                          compile_s=getattr(self.backend, "compile_s", 0.0),
                          dtype=getattr(self.backend, "dtype", "float32"), device=device_id(self.device))

    def join_broadcast(self, address: str, rank: int, world: int) -> int:
        """Join the learner's broadcast group (``rollout.weight_sync: broadcast``) as ``rank``."""
        return self.receiver.device.join_broadcast(address, rank, world)

    def busy_s(self) -> float:
        return self.busy.total

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 images: list[Any] | None = None) -> list[GenerateResult]:
        """``images[i]``: prompt i's images (``otray.vision.Image``s), for a vision-language model."""
        with self.busy():
            samples = self.backend.generate(prompts, params, n, **({"images": images} if images else {}))
        return [GenerateResult(s, self.version) for s in samples]

    def update_weights(self, update: WeightUpdate) -> int:
        """Load new weights (full or LoRA) and check that they are what the learner sent (the update's
        checksum against the sampler's tensors: :class:`~otray.types.WeightSyncError` otherwise);
        returns the worker's new policy version."""
        with self.busy():
            return self._update_weights(update)

    def _update_weights(self, update: WeightUpdate) -> int:
        from otray.actors.sampling.device_transport import verify, verify_held

        if update.kind not in ("full", "lora"):
            raise ValueError(f"unknown weight update kind {update.kind!r} (expected 'full' or 'lora')")
        tensors = self.receiver.tensors(update)
        if update.kind == "full":
            self.backend.load_full_weights(tensors)
        else:
            self.backend.load_lora(tensors, update.lora_config or {}, update.version)
        if update.checksum is not None:
            who, names = f"rollout worker on node {current_node_id()}", update.checksum.names
            received = {n: tensors[n] for n in names if n in tensors}
            verify(update.checksum, received, who, update.version)
            held = getattr(self.backend, "held", None)  # vLLM's weights live in its engine: checked as received
            if held is not None:
                verify_held(received, held(update.kind, names), who, update.version)
        self.version = update.version
        return self.version

    def rng_state(self) -> dict[str, Any]:
        """This worker's RNG states (what unseeded sampling draws from), for a checkpoint."""
        return rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's :meth:`rng_state`: a resumed job samples what the uninterrupted one did."""
        set_rng_state(state)

    def policy_version(self) -> int:
        return self.version

    def shutdown(self) -> None:
        stop = getattr(self.backend, "shutdown", None)
        if stop is not None:
            stop()


def wait_ready(handles: list[Any], timeout: float = 600.0) -> float:
    """Block until every actor answers ``ping``; returns seconds waited."""
    import ray

    t0 = time.perf_counter()
    ray.get([h.ping.remote() for h in handles], timeout=timeout)
    return time.perf_counter() - t0
