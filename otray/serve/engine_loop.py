"""EngineLoop: a vLLM model's requests served by continuous batching from one driver thread, streamed as they decode.

``LLM.generate`` runs every request it holds to its end, so a request that arrived during a call waited for the
whole call, and a streamed answer was a call per chunk over its prompt and the tokens so far (1.09-3.71x a
complete answer's time on the CPU build, more the longer the answer). Here one thread drives the engine a step at a
time (:class:`~otray.actors.sampling.backends.vllm_steps.EngineSteps`): before each step it admits the requests
that arrived, and each step's new tokens go to their requests' readers. A request is a :class:`Flow`, read whole
(:meth:`EngineLoop.generate`) or as it decodes (:meth:`EngineLoop.open`, :meth:`~EngineLoop.next`,
:meth:`~EngineLoop.close`: the interface of :class:`~otray.serve.streams.StreamTurns`, so the ModelServer streams
both alike).

Admission, first come first served (a request that cannot join waits, and so do those behind it):

- ``max_batch`` sequences (a request's ``n`` each) run at once; a request larger than that runs alone.
- A seeded request runs alone: its samples must not depend on which requests shared its steps.
- Requests of the base weights and of served adapters never share a step: vLLM's CPU build (0.32) gave a
  no-adapter prompt batched with adapter prompts a wrong answer (adapters mix fine). Kept on every device.
- From idle, the loop waits up to ``batch_wait_ms`` for as many requests as were in the system when the last
  ones ended (:class:`~otray.serve.recent_load.RecentLoad`); a lone client never waits.

Runs in a Serve replica's process (the ModelServer, or the Gateway in the single layout): its driver thread, and
the replica's generate threads that submit and read."""

from __future__ import annotations

import itertools
import shutil
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from otray.serve.recent_load import RecentLoad
from otray.serve.streams import Sofar
from otray.types import FinishReason, Sample, SamplingParams


@dataclass(eq=False)
class Flow:
    """One request: what it asks, the settings it runs with once admitted (``run``), each choice's tokens,
    logprobs and end so far, and ``version``: how many times its readers were given news (each ``chunk`` new
    tokens of its longest choice, and its end; ``chunk`` None: a complete answer, whose tokens the engine reports
    at its end only)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    n: int
    chunk: Optional[int] = 1
    adapter: Any = None
    images: tuple[Any, ...] = ()
    run: Optional[SamplingParams] = None
    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[Optional[FinishReason]] = field(default_factory=list)
    cached: int = 0
    version: int = 0
    unsent: int = 0  # new tokens since the last version
    error: Optional[BaseException] = None

    def __post_init__(self) -> None:
        self.ids, self.logprobs, self.finish = [[] for _ in range(self.n)], [[] for _ in range(self.n)], [None] * self.n

    @property
    def done(self) -> bool:
        return self.error is not None or all(f is not None for f in self.finish)

    def sofar(self) -> list[Sofar]:
        return [(list(ids), end) for ids, end in zip(self.ids, self.finish)]


class EngineLoop:
    """The requests of one vLLM backend's engine (no other caller may use the engine: its ``generate`` included)."""

    def __init__(self, backend: Any, max_batch: int = 32, batch_wait_s: float = 0.0):
        from otray.actors.sampling.backends.vllm_steps import EngineSteps

        self.steps = EngineSteps(backend)
        self.max_batch = max(1, max_batch)
        self.cond = threading.Condition()  # guards the queues and every flow; notified on news
        self.pending: deque[Flow] = deque()  # not yet in the engine
        self.running: dict[str, Flow] = {}
        self.aborts: list[str] = []  # running flows whose readers left: aborted before the next step
        self.retired: list[tuple[Any, str]] = []  # (adapter handle, its files): dropped once no flow uses them
        self.load = RecentLoad(batch_wait_s, self.max_batch)
        self.batches: deque[int] = deque(maxlen=1000)  # sequences per engine step, latest last (info, tests)
        self.calls = 0  # engine steps so far
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    # ------------------------------------------------------------------ requests

    def open(self, prompt: list[int], params: SamplingParams, n: int, chunk: int = 1, adapter: Any = None,
             images: tuple[Any, ...] = ()) -> Flow:
        """Queue a request: ``n`` choices of ``prompt`` (its stop strings in ``params.stop``) under ``adapter`` (a
        handle from :meth:`add_adapter`, or None), its readers woken every ``chunk`` tokens (None: at its end)."""
        flow = Flow(f"r{next(self._ids)}", list(prompt), params, n, None if chunk is None else max(1, chunk), adapter,
                    tuple(images))
        with self.cond:
            if self._stopped:
                raise RuntimeError("this model was unloaded: send the request again")
            self.pending.append(flow)
            self.cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive, name="engine-loop", daemon=True)
                self._thread.start()
        return flow

    def next(self, flow: Flow, seen: int) -> tuple[int, list[Sofar], bool]:
        """The flow's choices once it has news past the ``seen``-th (blocking): ``(version, each choice's tokens
        so far, whether they all ended)``; raises the error that ended it."""
        with self.cond:
            self.cond.wait_for(lambda: flow.version > seen or flow.done)
            if flow.error is not None:
                raise flow.error
            return flow.version, flow.sofar(), flow.done

    def close(self, flow: Flow) -> None:
        """The flow's reader is done (or gone): a queued flow leaves the queue, a running one is aborted, and a
        thread still waiting in :meth:`next` for it (its reader cancelled) gets an error instead of waiting on."""
        with self.cond:
            if flow.done:
                return
            if flow in self.pending:
                self.pending.remove(flow)
            elif flow.id in self.running:
                self.aborts.append(flow.id)
            flow.error = RuntimeError("the stream was closed by its reader")
            self.cond.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int, adapter: Any = None,
                 images: list[tuple[Any, ...]] | None = None) -> list[list[Sample]]:
        """Complete answers, as the backend's ``generate`` gives them (one request per prompt; a prompt that
        fails fails the call, after the others ended)."""
        flows = [self.open(p, params, n, chunk=None, adapter=adapter, images=im)
                 for p, im in zip(prompts, images or [()] * len(prompts))]
        with self.cond:
            self.cond.wait_for(lambda: all(f.done for f in flows))
        for f in flows:
            if f.error is not None:
                raise f.error
        return [[self.steps.sample(f.run, f.ids[i], f.logprobs[i], f.finish[i], f.cached) for i in range(f.n)]
                for f in flows]

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, name: str, path: str) -> Any:
        return self.steps.backend.add_adapter(name, path)  # between two steps (the engine's lock)

    def retire(self, adapter: Any, files: str) -> None:
        """Drop an adapter from the engine once no queued or running request uses it (the caller may be the GC)."""
        with self.cond:
            self.retired.append((adapter, files))
            self.cond.notify_all()

    def stop(self) -> None:
        """End the driver: queued and running requests fail (the model is being unloaded)."""
        with self.cond:
            self._stopped = True
            self.cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the driver thread

    def _drive(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._stopped or self.pending or self.running or self.aborts
                                   or self._unused())
                if self._stopped:
                    self._fail(list(self.pending) + list(self.running.values()),
                               RuntimeError("this model was unloaded: send the request again"))
                    self.pending.clear()
                    return
                if not self.running and self.pending:  # from idle: those on their way back
                    self.load.gather(self.cond, lambda: len(self.pending))
                admit, aborts, self.aborts = self._admit(), self.aborts, []
                drop = self._unused()
                self.retired = [r for r in self.retired if r not in drop]
            news, error = [], None
            with self.steps.lock:  # the engine's (reentrant): drops, aborts, admissions and the step together
                for handle, files in drop:
                    _drop_adapter(self.steps.backend, handle, files)
                for rid in aborts:
                    self.steps.abort(rid)
                for flow in admit:
                    try:
                        flow.run = self.steps.add(flow.id, flow.prompt, flow.params, flow.n, flow.adapter, flow.images,
                                                  stream=flow.chunk is not None)
                    except Exception as e:  # noqa: BLE001 - this request's own error (a prompt too long)
                        flow.error = e
                try:
                    if self.steps.busy:
                        news = self.steps.step()
                except Exception as e:  # noqa: BLE001 - the engine failed: every running request with it
                    error = e
            with self.cond:
                if self._apply(admit, aborts, news, error):
                    self.cond.notify_all()

    def _admit(self) -> list[Flow]:
        """The queued flows that join the running ones now (under ``cond``), first come first served."""
        running = list(self.running.values())
        out: list[Flow] = []
        while self.pending:
            flow, together = self.pending[0], running + out
            if together:
                seeded = flow.params.seed is not None or any(f.params.seed is not None for f in together)
                base = (flow.adapter is None) != (together[0].adapter is None)
                if seeded or base or sum(f.n for f in together) + flow.n > self.max_batch:
                    break
            out.append(self.pending.popleft())
        return out

    def _apply(self, admit: list[Flow], aborts: list[str], news: list[Any], error: Optional[BaseException]) -> bool:
        """A step's outcome into its flows (under ``cond``); whether a reader has news (waking them all each step
        cost the engine's thread the GIL every step)."""
        for rid in aborts:
            self.running.pop(rid, None)
        woken = False
        for flow in admit:
            if flow.error is None:
                self.running[flow.id] = flow
            woken = True  # a reader waits on its error; the load gatherer on the pending queue
        if error is not None:
            self._fail(list(self.running.values()), error)
            return True
        if self.running:
            self.calls += 1
            self.batches.append(sum(f.n for f in self.running.values()))
        grown: dict[str, int] = {}
        for p in news:
            flow = self.running.get(p.request)
            if flow is None:
                continue
            flow.ids[p.choice].extend(p.token_ids)
            flow.logprobs[p.choice].extend(p.logprobs)
            flow.finish[p.choice] = p.finish or flow.finish[p.choice]
            flow.cached = max(flow.cached, p.cached_prompt_tokens)
            grown[flow.id] = max(grown.get(flow.id, 0), len(p.token_ids))
        for rid, tokens in grown.items():
            flow = self.running[rid]
            flow.unsent += tokens
            if flow.done or (flow.chunk is not None and flow.unsent >= flow.chunk):
                flow.version, flow.unsent, woken = flow.version + 1, 0, True
        in_system = len(self.running) + len(self.pending)
        for flow in [f for f in self.running.values() if f.done]:
            del self.running[flow.id]
            self.load.ended(in_system)
        return woken

    def _fail(self, flows: list[Flow], error: BaseException) -> None:
        for flow in flows:
            flow.error = flow.error or error
            self.running.pop(flow.id, None)

    def _unused(self) -> list[tuple[Any, str]]:
        """The retired adapters no queued or running flow uses (under ``cond``)."""
        used = {id(f.adapter) for f in itertools.chain(self.pending, self.running.values())}
        return [r for r in self.retired if id(r[0]) not in used]


def _drop_adapter(backend: Any, handle: Any, files: str) -> None:
    try:
        backend.remove_adapter(handle)
    except Exception:  # noqa: BLE001 - the engine may be gone already
        pass
    shutil.rmtree(files, ignore_errors=True)
