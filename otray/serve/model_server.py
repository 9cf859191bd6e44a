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
import functools
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from otray.serve.config import ServeModel
from otray.serve.openai_api import APIError, Choice, apply_stop
from otray.types import FinishReason, SamplingParams


@dataclass
class Job:
    """What the app sends a replica: validated token ids and sampling settings."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stop: list[str]
    images: tuple[Any, ...] = ()  # the prompt's images (``otray.vision.Image``), whose tokens it holds


class Loaded:
    """A model ready to generate, with dynamic batching.

    Concurrent requests are queued; one thread at a time runs the backend, taking every
    queued request whose sampling settings and ``n`` equal the first one's (up to
    ``max_batch`` prompts; requests for several adapters of a vLLM base share a call, the
    base's own requests go in calls of their own) into one ``generate`` call, so 8 concurrent chats cost about
    one batched generate instead of 8 in a row. Requests with a ``seed`` run alone: their
    samples must not depend on which other requests shared the batch.

    ``batch_wait_ms``: before a call, wait up to this long until as many prompts are queued
    as were in the system (in the call + queued) when the last 8 calls ended. Clients whose
    answers just went out are on their way back; without waiting for them, 8 steady clients
    settle into alternating calls of 7 and 1 (or 4 and 4), halving throughput. A lone
    client never waits (its load is 1).
    """

    def __init__(self, backend: Any, name: str, cleanup: str | None = None, max_batch: int = 32,
                 batch_wait_ms: float = 0.0):
        self.backend, self.name, self.cleanup, self.max_batch = backend, name, cleanup, max(1, max_batch)
        self.batch_wait_s = batch_wait_ms / 1000
        self.lock = threading.Lock()  # held by the thread running the backend
        self.queue: list[_Pending] = []
        self.queue_lock = threading.Lock()
        self.arrived = threading.Condition(self.queue_lock)  # notified when a request joins the queue
        self.batches: deque[int] = deque(maxlen=1000)  # prompts per backend call, latest last (for info and tests)
        # prompts in the system when each recent call ended (its own + those queued meanwhile): the load
        # that batch_wait_ms waits to gather, since closed-loop clients come back after their answer
        self.load: deque[int] = deque(maxlen=8)
        self.calls = 0  # backend calls so far
        self.retired: list[tuple[Any, str]] = []  # (adapter handle, its files): dropped before the next call

    def add_adapter(self, name: str, path: str) -> Any:
        with self.lock:  # the engine is not thread-safe: never while a batch runs
            return self.backend.add_adapter(name, path)

    def retire(self, adapter: Any, files: str) -> None:
        """Drop an adapter from the engine before the next call (not now: the caller may be the GC,
        running inside a batch that holds the lock)."""
        with self.queue_lock:
            self.retired.append((adapter, files))

    def _drop_retired(self) -> None:
        with self.queue_lock:
            retired, self.retired = self.retired, []
        for adapter, files in retired:
            try:
                self.backend.remove_adapter(adapter)
            except Exception:  # noqa: BLE001 - the engine may be gone already
                pass
            shutil.rmtree(files, ignore_errors=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 adapter: Any = None, images: list[tuple[Any, ...]] | None = None) -> list[list[Any]]:
        """``adapter``: a handle from the backend's ``add_adapter`` (vLLM), or None for the base weights;
        ``images``: each prompt's images (a vision-language model)."""
        mine = _Pending(prompts, params, n, adapter, images or [()] * len(prompts))
        with self.arrived:
            self.queue.append(mine)
            self.arrived.notify_all()
        while not mine.done.is_set():
            with self.lock:  # whoever holds the lock serves a batch: maybe ours, maybe others'
                if mine.done.is_set():
                    break
                self._run_batch()
        if mine.error is not None:
            raise mine.error
        return mine.results

    def _run_batch(self) -> None:
        if self.retired:
            self._drop_retired()
        with self.arrived:
            if self.batch_wait_s:  # let requests on their way join: as many as recent load, or time's up
                want = min(self.max_batch, max(self.load, default=1))
                self.arrived.wait_for(lambda: sum(len(p.prompts) for p in self.queue) >= want, self.batch_wait_s)
            if not self.queue:
                return
            first, size, batch = self.queue[0], 0, []
            for p in list(self.queue):
                # base-only and adapter prompts never share a call: on vLLM's CPU build (0.32) a prompt
                # without an adapter came out wrong when batched with adapter prompts (adapters mix fine)
                same = (p.params == first.params and p.n == first.n and first.params.seed is None
                        and (p.adapter is None) == (first.adapter is None))
                if p is first or (same and size + len(p.prompts) <= self.max_batch):
                    batch.append(p)
                    size += len(p.prompts)
                    self.queue.remove(p)
                    if first.params.seed is not None:
                        break
        self.batches.append(size)
        self.calls += 1
        try:
            prompts = [x for p in batch for x in p.prompts]
            extra = _images([im for p in batch for im in p.images])
            if any(p.adapter is not None for p in batch):  # one engine call, an adapter per prompt
                out = self.backend.generate(prompts, first.params, first.n,
                                            adapters=[p.adapter for p in batch for _ in p.prompts], **extra)
            else:
                out = self.backend.generate(prompts, first.params, first.n, **extra)
            at = 0
            for p in batch:
                p.results, at = out[at:at + len(p.prompts)], at + len(p.prompts)
        except BaseException as e:  # noqa: BLE001 - a failed batch fails each of its requests
            for p in batch:
                p.error = e if len(batch) == 1 else _alone(self.backend, p, e)
        finally:
            with self.queue_lock:
                self.load.append(size + sum(len(p.prompts) for p in self.queue))
            for p in batch:
                p.done.set()

    def __del__(self) -> None:  # evicted by Serve's multiplexing (LRU): free the files too
        if self.cleanup:
            shutil.rmtree(self.cleanup, ignore_errors=True)
        stop = getattr(self.backend, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


@dataclass
class _Pending:
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    adapter: Any = None
    images: list[tuple[Any, ...]] = field(default_factory=list)  # per prompt
    results: list[list[Any]] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _alone(backend: Any, p: _Pending, batch_error: BaseException) -> BaseException | None:
    """A batch failed (say one prompt was too long): rerun this request by itself, so one
    bad request cannot fail the others; returns its own error, or None with results set."""
    try:
        extra = {} if p.adapter is None else {"adapters": [p.adapter] * len(p.prompts)}
        extra.update(_images(p.images))
        p.results = backend.generate(p.prompts, p.params, p.n, **extra)
        return None
    except BaseException as e:  # noqa: BLE001
        return e


def _images(per_prompt: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The ``images=`` argument of a backend call, only when a prompt has any (text backends take none)."""
    return {"images": per_prompt} if any(per_prompt) else {}


class Adapter:
    """A LoRA checkpoint served on the base model's vLLM engine: generation goes through the
    base's batcher (``Loaded``) with this adapter named per prompt, so requests for several
    adapters share engine calls. Dropping it (Serve's LRU eviction) removes
    the adapter from the engine and deletes its files."""

    def __init__(self, base: Loaded, name: str, path: str, cleanup: str):
        self.base, self.name, self.cleanup = base, name, cleanup
        self.handle = base.add_adapter(name, path)
        self.backend = base.backend  # for max_model_len / name, as a Loaded offers
        self.removed = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 images: list[tuple[Any, ...]] | None = None) -> list[list[Any]]:
        return self.base.generate(prompts, params, n, adapter=self.handle, images=images)

    def __del__(self) -> None:  # Serve calls it on eviction, and the GC again later: once is enough
        if getattr(self, "removed", True):
            return
        self.removed = True
        self.base.retire(self.handle, self.cleanup)


@dataclass
class ReplicaInfo:
    """What a serving replica reports: its base model, backend, loaded checkpoints, and the prompts per
    base-model call of its last calls (``batches``) with the count of calls (benchmarks, dashboard)."""

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
        """Yield ``(choice index, new text, finish_reason or None, tokens so far)`` as tokens arrive:
        all choices advance together, ``stream_chunk_tokens`` tokens per backend call."""
        ids: list[list[int]] = [[] for _ in range(job.n)]
        sent, done = [0] * job.n, [None] * job.n
        hold = max((len(s) for s in job.stop), default=1) - 1  # a stop string may still be forming
        calls = 0
        while any(d is None for d in done):
            live = [i for i in range(job.n) if done[i] is None]
            budget = min(self.chunk, *(job.params.max_tokens - len(ids[i]) for i in live))
            seed = None if job.params.seed is None else job.params.seed + calls
            params = replace(job.params, max_tokens=budget, seed=seed)
            results = await self.in_thread(functools.partial(model.generate, images=[job.images] * len(live)),
                                           [job.prompt_ids + ids[i] for i in live], params, 1)
            calls += 1
            for i, res in zip(live, results):
                sample = res[0]
                ids[i].extend(sample.token_ids)
                stopped = sample.finish_reason is FinishReason.STOP
                text, reason = self._decode(ids[i], FinishReason.STOP if stopped else FinishReason.LENGTH, job.stop)
                if stopped or reason == "stop":
                    done[i] = "stop"
                elif len(ids[i]) >= job.params.max_tokens or not sample.token_ids:
                    done[i] = "length"
                safe = text if done[i] else text[:max(sent[i], len(text) - hold)]
                if not done[i] and safe.endswith("\ufffd"):  # half a multi-byte character
                    safe = safe[:-1]
                if len(safe) > sent[i] or done[i]:
                    yield i, safe[sent[i]:], done[i], len(ids[i])
                    sent[i] = len(safe)


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
