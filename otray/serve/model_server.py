"""ModelServer: one base model on one Serve replica, plus trained checkpoints loaded on demand.

The replica holds the base model's rollout backend (the same ``hf`` / ``vllm`` backends
that jobs sample from) and, multiplexed by Ray Serve, the checkpoints that requests name
(``job-<id>:<step>``; the app resolves ``job-<id>`` to its latest step first). A
checkpoint is fetched as a blob from the ResourceManager, unpacked on this node and
loaded: a full-weight checkpoint as its own backend; a LoRA adapter, on a vLLM base with
``max_lora_rank`` >= its rank, as an adapter of the base engine (vLLM multi-LoRA: no
second copy of the weights, and one engine call may serve several adapters),
otherwise merged into a copy of the base model (HF backend). Past
``max_loaded_checkpoints`` the least recently used one is dropped (Ray Serve's
multiplexing evicts it and routes later requests for a model to the replica that has it).

Generation works on token ids the app already validated; text, stop strings and finish
reasons are settled here, so streamed and complete answers agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from otray.serve.batching import Adapter, Loaded
from otray.serve.config import ServeModel
from otray.serve.engine_loop import EngineLoop
from otray.serve.openai_api import APIError, Choice, apply_stop
from otray.serve.streams import Sofar, StreamTurns
from otray.types import FinishReason, SamplingParams


@dataclass
class Job:
    """What the app sends a replica: validated token ids and sampling settings."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stop: list[str]
    images: tuple[Any, ...] = ()  # the prompt's images (``otray.vision.Image``), whose tokens it holds


@dataclass
class ReplicaInfo:
    """What a serving replica reports: its base model, backend, loaded checkpoints, and the prompts per
    base-model call of its last calls (``batches``) with the count of calls (a vLLM model: sequences per engine
    step, and steps; benchmarks, tests)."""

    name: str
    path: str
    max_model_len: int
    backend: str
    loaded: list[str]
    batches: list[int]
    calls: int


class ModelServer:
    """Plain class; ``otray.serve.app`` wraps it in a Serve deployment with ``serve.multiplexed``."""

    def __init__(self, model: ServeModel, cache_dir: str = ".cache/models", stream_chunk_tokens: int = 4):
        import torch

        from otray.actors.sampling.rollout import make_backend
        from otray.models import load_tokenizer, resolve_model_path

        self.spec = model
        if model.num_threads:
            torch.set_num_threads(int(model.num_threads))
        self.path = resolve_model_path(model.path, cache_dir)
        self.kwargs = {"dtype": model.dtype, "max_model_len": model.max_model_len, "kv_cache_gb": model.kv_cache_gb,
                       "seed": 0}
        # LoRA slots on a vLLM base engine: one per checkpoint the replica may hold
        lora = {"max_lora_rank": model.max_lora_rank, "max_loras": max(1, model.max_loaded_checkpoints)}
        self.base = Loaded(make_backend(model.backend, self.path, **self.kwargs, **lora), model.name,
                           max_batch=model.max_batch, batch_wait_ms=model.batch_wait_ms)
        self.tokenizer = load_tokenizer(self.path)
        self.chunk = max(1, stream_chunk_tokens)
        # one thread per request the replica may hold (asyncio's default pool has only
        # cpus + 4, which would cap how many requests can wait to share a batch)
        self.pool = ThreadPoolExecutor(model.max_ongoing_requests + 2, thread_name_prefix="generate")
        self.loaded_ids: list[str] = []  # for tests and the dashboard: what this replica has loaded

    def ping(self) -> bool:
        return True

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.spec.name, self.path, self.base.backend.max_model_len, self.base.backend.name,
                           list(self.loaded_ids), list(self.base.batches), self.base.calls)

    # ------------------------------------------------------------------ checkpoints

    def load_checkpoint(self, model_id: str) -> Loaded | Adapter:
        """``job-<id>:<step>:<grant>`` -> a model to generate with (blocking; the deployment runs it off the
        event loop). The grant is the ResourceManager's, given to the Gateway for a caller who owns the job."""
        import ray

        from otray.checkpoints import unpack_dir
        from otray.actors.control.resource_manager import NAME, NAMESPACE

        job_id, step, grant = (model_id.removeprefix("job-").split(":") + ["", ""])[:3]
        try:
            rm = ray.get_actor(NAME, namespace=NAMESPACE)
            blob = ray.get(rm.serve_checkpoint_blob.remote(job_id, int(step), grant))
        except Exception as e:  # noqa: BLE001 - no RM, unknown job or step: the model does not exist
            raise APIError(404, f"model job-{job_id}:{step} could not be loaded: {e}", code="model_not_found") from None
        where = tempfile.mkdtemp(prefix=f"otray-serve-{job_id}-{step}-")
        model_dir = Path(unpack_dir(blob, Path(where) / "ckpt")) / "model"
        model = self.open_checkpoint(model_dir, model_id, where)
        self.loaded_ids.append(model_id)
        return model

    def open_checkpoint(self, model_dir: Path, model_id: str, cleanup: str) -> Loaded | Adapter:
        """A checkpoint's ``model`` directory, unpacked under ``cleanup`` (deleted when it is dropped),
        ready to generate: an adapter on the base engine where it can be, else a backend of its own."""
        from otray.actors.sampling.rollout import make_backend

        if (model_dir / "adapter_config.json").exists():
            if self.serves_adapters(model_dir):
                return Adapter(self.base, model_id, str(model_dir), cleanup)
            backend = make_backend("hf", self._merge_adapter(model_dir, Path(cleanup) / "merged"), **self.kwargs)
        else:
            backend = make_backend(self.spec.backend, str(model_dir), **self.kwargs)
        return Loaded(backend, model_id, cleanup=cleanup, max_batch=self.spec.max_batch,
                      batch_wait_ms=self.spec.batch_wait_ms)

    def serves_adapters(self, adapter_dir: Path) -> bool:
        """Whether the base engine can serve this adapter as is (vLLM with enough LoRA rank)."""
        import json

        slots = getattr(self.base.backend, "max_lora_rank", 0)
        rank = int(json.loads((adapter_dir / "adapter_config.json").read_text()).get("r", 0))
        return hasattr(self.base.backend, "add_adapter") and 0 < rank <= slots

    def _merge_adapter(self, adapter_dir: Path, out: Path) -> str:
        """A LoRA checkpoint as a full model: the base with the adapter merged in, saved under ``out``."""
        from peft import PeftModel

        from otray.models import copy_side_files, load_model

        merged = PeftModel.from_pretrained(load_model(self.path, self.spec.dtype), str(adapter_dir)).merge_and_unload()
        merged.save_pretrained(out, safe_serialization=True)
        copy_side_files(self.path, out)
        return str(out)

    # ------------------------------------------------------------------ generation

    async def in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _decode(self, ids: list[int], finish: FinishReason, stop: list[str]) -> tuple[str, str]:
        body = ids[:-1] if finish is FinishReason.STOP else ids
        text, hit = apply_stop(self.tokenizer.decode(body, skip_special_tokens=True), stop)
        return text, "stop" if hit or finish is FinishReason.STOP else "length"

    def complete(self, model: Loaded | Adapter, job: Job) -> list[Choice]:
        samples = model.generate([job.prompt_ids], job.params, job.n, images=[job.images])[0]
        out = []
        for s in samples:
            text, reason = self._decode(s.token_ids, s.finish_reason, job.stop)
            out.append(Choice(text, reason, len(s.token_ids)))
        return out

    async def stream(self, model: Loaded | Adapter, job: Job) -> AsyncIterator[tuple[int, str, str | None, int]]:
        """Yield ``(choice index, new text, finish_reason or None, tokens so far)`` as tokens arrive, all choices
        advancing together ``stream_chunk_tokens`` tokens at a time. A vLLM model's stream is a request of its
        engine loop (:mod:`otray.serve.engine_loop`: each chunk read as the engine's steps make it); an HF model's
        without images is decoded in turns (:mod:`otray.serve.streams`: no token computed twice, concurrent streams
        with equal settings decoded together); either way a seeded answer equals its complete one. Otherwise (an
        HF model with images, the compiled sampler) each chunk is a backend call of its own over the prompt and the
        tokens so far."""
        done: list[str | None] = [None] * job.n
        sent = [0] * job.n
        hold = max((len(s) for s in job.stop), default=1) - 1  # a stop string may still be forming
        streams, extra = _streams_of(model, job)
        rounds = self._turn_rounds(streams, job, extra) if streams is not None else self._chunk_rounds(model, job, done)
        async with contextlib.aclosing(rounds) as each:
            async for sofar in each:
                for i, (ids, finish) in enumerate(sofar):
                    if done[i] is not None:
                        continue
                    stopped = finish is FinishReason.STOP  # its last token is the stop id
                    text, reason = self._decode(ids, FinishReason.STOP if stopped else FinishReason.LENGTH, job.stop)
                    if stopped or reason == "stop" or finish is FinishReason.STOP_STRING:
                        done[i] = "stop"
                    elif finish is not None or len(ids) >= job.params.max_tokens:
                        done[i] = "length"
                    safe = text if done[i] else text[:max(sent[i], len(text) - hold)]
                    if not done[i] and safe.endswith("\ufffd"):  # half a multi-byte character
                        safe = safe[:-1]
                    if len(safe) > sent[i] or done[i]:
                        yield i, safe[sent[i]:], done[i], len(ids)
                        sent[i] = len(safe)
                if all(d is not None for d in done):
                    return

    async def _turn_rounds(self, streams: StreamTurns | EngineLoop, job: Job, extra: dict[str, Any]
                           ) -> AsyncIterator[list[Sofar]]:
        """Each choice's tokens so far after each turn of the stream (its stop strings end its choices)."""
        stream = streams.open(job.prompt_ids, replace(job.params, stop=tuple(job.stop)), job.n, self.chunk, **extra)
        seen = 0
        try:
            while True:
                seen, sofar, finished = await self.in_thread(streams.next, stream, seen)
                yield sofar
                if finished:
                    return
        finally:
            streams.close(stream)

    async def _chunk_rounds(self, model: Loaded | Adapter, job: Job, done: list[str | None]
                            ) -> AsyncIterator[list[Sofar]]:
        """Each choice's tokens so far after each chunk: a backend call over the prompt and the tokens so far of
        every choice not ``done`` (the stream's own record), its seed advanced per call."""
        ids: list[list[int]] = [[] for _ in range(job.n)]
        calls = 0
        while True:
            live = [i for i in range(job.n) if done[i] is None]
            if not live:
                return
            budget = min(self.chunk, *(job.params.max_tokens - len(ids[i]) for i in live))
            seed = None if job.params.seed is None else job.params.seed + calls
            params = replace(job.params, max_tokens=budget, seed=seed)
            results = await self.in_thread(functools.partial(model.generate, images=[job.images] * len(live)),
                                           [job.prompt_ids + ids[i] for i in live], params, 1)
            calls += 1
            finish: list[FinishReason | None] = [None] * job.n
            for i, res in zip(live, results):
                sample = res[0]
                ids[i].extend(sample.token_ids)
                if sample.finish_reason is FinishReason.STOP:
                    finish[i] = FinishReason.STOP
                elif not sample.token_ids:  # the context is full
                    finish[i] = FinishReason.LENGTH
            yield [(ids[i], finish[i]) for i in range(job.n)]


def _streams_of(model: Loaded | Adapter, job: Job) -> tuple[StreamTurns | EngineLoop | None, dict[str, Any]]:
    """What decodes ``job``'s stream a turn at a time, with what it needs besides the prompt and settings: a vLLM
    model's engine loop (an adapter's: its base's, with its handle; images too), an HF model's turns (without
    images), else None (a backend call per chunk)."""
    if isinstance(model, Adapter):
        return model.base.engine, {"adapter": model.handle, "images": job.images}
    if model.engine is not None:
        return model.engine, {"images": job.images}
    return (model.streams, {}) if model.streams is not None and not job.images else (None, {})


def serve_class(max_loaded: int) -> type:
    """``ModelServer`` with Serve's multiplexed checkpoint loader (at most ``max_loaded`` per replica)."""
    from ray import serve

    class MultiplexedModelServer(ModelServer):
        @serve.multiplexed(max_num_models_per_replica=max_loaded)
        async def checkpoint(self, model_id: str) -> Loaded | Adapter:
            return await asyncio.to_thread(self.load_checkpoint, model_id)

        async def model(self) -> Loaded | Adapter:
            model_id = serve.get_multiplexed_model_id()
            return await self.checkpoint(model_id) if model_id else self.base

        async def generate(self, job: Job) -> list[Choice]:
            model = await self.model()
            return await self.in_thread(self.complete, model, job)

        async def generate_stream(self, job: Job) -> AsyncIterator[tuple[int, str, str | None, int]]:
            model = await self.model()
            async for item in self.stream(model, job):
                yield item

    return MultiplexedModelServer
