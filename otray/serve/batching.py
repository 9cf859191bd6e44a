"""Loaded: one model ready to generate, with the dynamic batching of its complete answers (and, on an HF
model, its streams: :mod:`otray.serve.streams`; a vLLM model's requests are continuously batched instead:
:mod:`otray.serve.engine_loop`); Adapter: a LoRA checkpoint served on a vLLM base's engine.

Runs in a Serve replica's process (the ModelServer, or the Gateway in the single layout), on its generate
threads."""

from __future__ import annotations

import shutil
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from otray.serve.engine_loop import EngineLoop
from otray.serve.recent_load import RecentLoad
from otray.serve.streams import StreamTurns
from otray.types import SamplingParams


class Loaded:
    """A model ready to generate, with dynamic batching.

    Concurrent requests are queued; one thread at a time runs the backend, taking every
    queued request whose sampling settings and ``n`` equal the first one's (up to
    ``max_batch`` prompts) into one ``generate`` call, so 8 concurrent chats cost about
    one batched generate instead of 8 in a row. Requests with a ``seed`` run alone: their
    samples must not depend on which other requests shared the batch.

    ``batch_wait_ms``: before a call, wait up to this long until as many prompts are queued
    as were in the system (in the call + queued) when the last 8 calls ended. Clients whose
    answers just went out are on their way back; without waiting for them, 8 steady clients
    settle into alternating calls of 7 and 1 (or 4 and 4), halving throughput. A lone
    client never waits (its load is 1).

    ``streams``: on an HF backend (not compiled), streamed requests decoded in turns
    (:class:`~otray.serve.streams.StreamTurns`), which take the same lock as the calls, between them. On a vLLM
    backend, ``engine`` (:class:`~otray.serve.engine_loop.EngineLoop`) serves every request, complete and
    streamed (``streams`` is it too): requests join the engine between its steps, so there are no calls to batch.
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
        self.load = RecentLoad(self.batch_wait_s, self.max_batch)  # prompts: what batch_wait_ms waits to gather
        self._calls = 0  # backend calls so far
        # streamed answers decoded in turns between the calls (an HF backend's ``turns``; the compiled sampler
        # decodes a batch whole): None streams each chunk as a call of its own
        self.streams: StreamTurns | EngineLoop | None = StreamTurns(
            backend, self.lock, self.max_batch, self.batch_wait_s) if (
            callable(getattr(backend, "turns", None)) and getattr(backend, "compiled", None) is None) else None
        self.engine = EngineLoop(backend, self.max_batch, self.batch_wait_s) if getattr(backend, "name", "") == "vllm" \
            else None
        if self.engine is not None:
            self.streams, self.batches = self.engine, self.engine.batches

    @property
    def calls(self) -> int:
        """Backend calls so far (a vLLM model: engine steps)."""
        return self.engine.calls if self.engine is not None else self._calls

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 images: list[tuple[Any, ...]] | None = None) -> list[list[Any]]:
        """``images``: each prompt's images (a vision-language model)."""
        if self.engine is not None:
            return self.engine.generate(prompts, params, n, images=images)
        mine = _Pending(prompts, params, n, images or [()] * len(prompts))
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
        with self.arrived:
            self.load.gather(self.arrived, lambda: sum(len(p.prompts) for p in self.queue))  # those on their way
            if not self.queue:
                return
            first, size, batch = self.queue[0], 0, []
            for p in list(self.queue):
                same = p.params == first.params and p.n == first.n and first.params.seed is None
                if p is first or (same and size + len(p.prompts) <= self.max_batch):
                    batch.append(p)
                    size += len(p.prompts)
                    self.queue.remove(p)
                    if first.params.seed is not None:
                        break
        self.batches.append(size)
        self._calls += 1
        try:
            prompts = [x for p in batch for x in p.prompts]
            extra = _images([im for p in batch for im in p.images])
            out = self.backend.generate(prompts, first.params, first.n, **extra)
            at = 0
            for p in batch:
                p.results, at = out[at:at + len(p.prompts)], at + len(p.prompts)
        except BaseException as e:  # noqa: BLE001 - a failed batch fails each of its requests
            for p in batch:
                p.error = e if len(batch) == 1 else _alone(self.backend, p, e)
        finally:
            with self.queue_lock:
                self.load.ended(size + sum(len(p.prompts) for p in self.queue))
            for p in batch:
                p.done.set()

    def __del__(self) -> None:  # evicted by Serve's multiplexing (LRU): free the files too
        if self.cleanup:
            shutil.rmtree(self.cleanup, ignore_errors=True)
        if getattr(self, "engine", None) is not None:
            self.engine.stop()
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
    images: list[tuple[Any, ...]] = field(default_factory=list)  # per prompt
    results: list[list[Any]] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _alone(backend: Any, p: _Pending, batch_error: BaseException) -> BaseException | None:
    """A batch failed (say one prompt was too long): rerun this request by itself, so one
    bad request cannot fail the others; returns its own error, or None with results set."""
    try:
        p.results = backend.generate(p.prompts, p.params, p.n, **_images(p.images))
        return None
    except BaseException as e:  # noqa: BLE001
        return e


def _images(per_prompt: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The ``images=`` argument of a backend call, only when a prompt has any (text backends take none)."""
    return {"images": per_prompt} if any(per_prompt) else {}


class Adapter:
    """A LoRA checkpoint served on the base model's vLLM engine: its requests go through the base's engine
    loop with this adapter named, so requests for several adapters share engine steps. Dropping it (Serve's LRU
    eviction) removes the adapter from the engine, once no request uses it, and deletes its files."""

    def __init__(self, base: Loaded, name: str, path: str, cleanup: str):
        if base.engine is None:
            raise ValueError(f"{base.name} has no engine loop: only a vLLM base model serves adapters")
        self.base, self.name, self.cleanup = base, name, cleanup
        self.handle = base.engine.add_adapter(name, path)
        self.backend = base.backend  # for max_model_len / name, as a Loaded offers
        self.removed = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 images: list[tuple[Any, ...]] | None = None) -> list[list[Any]]:
        return self.base.engine.generate(prompts, params, n, adapter=self.handle, images=images)

    def __del__(self) -> None:  # Serve calls it on eviction, and the GC again later: once is enough
        if getattr(self, "removed", True):
            return
        self.removed = True
        self.base.engine.retire(self.handle, self.cleanup)
