"""The vLLM samplers of the Tinker service: per base model, a :class:`~otray.tinker.learner.lora_sampler.LoraSampler`
actor, started on the first sample request it can serve.

:meth:`VllmSamplers.serves` is the routing rule (:mod:`otray.tinker.service.sampling` asks it for every group
of requests): the base model and every sampler checkpoint vLLM can sample exactly go to the engine,
the rest (``train_unembed`` adapters, ranks above the engine's slots, base models configured with
``sampler.engine: learner``) to the learner's HF ``generate``.

An engine that does not start (vLLM missing or broken, no free CPU or GPU for it within
``start_timeout_s``) is a fallback under ``engine: auto``: the reason is kept (:attr:`VllmSamplers.down`)
and that model's requests go to the learner from then on. Under ``engine: vllm`` it is an error,
given to every request routed there, that says what failed.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import ray

from otray.tinker.learner.specs import AdapterSpec
from otray.tinker.learner.lora_sampler import LoraSampler, checkpoint_spec, serves
from otray.placement import threads_env
from otray.tinker.config import TinkerModel
from otray.tinker.service.runs import cause

log = logging.getLogger(__name__)


class VllmSamplers:
    def __init__(self, models: dict[str, TinkerModel], paths: dict[str, str], name_prefix: str, namespace: str):
        from otray.actors.sampling.backends.vllm import vllm_available

        # (vLLM is imported to check it only where auto would use it: importing it costs seconds)
        self.models = {n: m for n, m in models.items() if m.sampler.engine == "vllm"
                       or (m.sampler.engine == "auto" and m.sampler.gpus > 0 and vllm_available())}
        self.paths = paths
        self.prefix, self.namespace = name_prefix, namespace
        self.starting: dict[str, asyncio.Future] = {}
        self.down: dict[str, str] = {}  # base model -> why its engine is not used (auto fell back to the learner)
        self.specs: dict[str, AdapterSpec] = {}  # checkpoint dir -> its adapter's shape (a cache)

    def serves(self, base: str, adapter: Optional[str]) -> bool:
        """Whether requests for ``adapter`` (a checkpoint dir; None: the base weights) of ``base`` go to vLLM."""
        m = self.models.get(base)
        if m is None or base in self.down:
            return False
        if adapter is None:
            return True
        if adapter not in self.specs:
            if len(self.specs) >= 10_000:  # every RL step saves a new ephemeral dir: keep the cache bounded
                self.specs.clear()
            try:
                self.specs[adapter] = checkpoint_spec(adapter)
            except OSError:  # deleted since: the learner's path says so to the client
                return False
        return serves(self.specs[adapter], m.sampler.max_lora_rank)

    async def actor(self, base: str) -> Optional[Any]:
        """The running engine of ``base``, started on the first call; None when it could not start and
        the model falls back to the learner (``auto``); raises RuntimeError when it could not (``vllm``)."""
        if base not in self.starting:
            self.starting[base] = asyncio.ensure_future(self._start(base))
        return await asyncio.shield(self.starting[base])

    def forget(self, base: str) -> None:
        """``base``'s engine died: the next request it can serve starts a new one."""
        self.starting.pop(base, None)

    async def _start(self, base: str) -> Optional[Any]:
        s = self.models[base].sampler
        env = threads_env(s.num_threads or max(1, int(s.cpus)), s.cpus)  # the KV cache: kv_cache_gb, set by the engine
        handle = ray.remote(LoraSampler).options(
            name=f"{self.prefix}-sampler-{base}", namespace=self.namespace, get_if_exists=True,
            num_cpus=s.cpus, num_gpus=s.gpus, **env).remote(
            self.paths[base], max_lora_rank=s.max_lora_rank, max_loras=s.max_loras,
            max_model_len=self.models[base].max_context_length, kv_cache_gb=s.kv_cache_gb,
            num_threads=s.num_threads or max(1, int(s.cpus)), gpu_memory_utilization=s.gpu_memory_utilization)
        try:
            await asyncio.wait_for(handle.ping.remote(), s.start_timeout_s)
            return handle
        except Exception as e:  # noqa: BLE001 - any failure to start is reported the same way
            why = (f"the vLLM sampler of {base} did not start within {s.start_timeout_s:.0f} s (no free CPU or GPU "
                   f"for it: sampler.cpus={s.cpus}, sampler.gpus={s.gpus})" if isinstance(e, asyncio.TimeoutError)
                   else f"the vLLM sampler of {base} failed to start: {cause(e)}")
            ray.kill(handle)
            if s.engine == "auto":
                self.down[base] = why
                log.warning("%s; sampling %s on its learner from now on", why, base)
                return None
            raise RuntimeError(f"{why}; fix it and restart the service, or set sampler.engine: learner") from None
