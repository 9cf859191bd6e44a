"""Promises and their order: what the Tinker service returns at once for every mutating call, and
how it applies each model's calls in ``seq_id`` order.

- :class:`Futures`: one entry per request id, with its owner; ``wait`` long-polls until the
  result is in or the poll time is up (the SDK then polls again). A result is kept until
  ``ttl_s`` after it finished.
- :class:`OrderedExecutor`: the SDK numbers each training client's requests (``seq_id`` 1, 2,
  ...) and pipelines them (several ``forward_backward`` chunks, then ``optim_step``, before
  waiting for any). Requests run strictly in that order, one at a time per model; a request
  that arrives early waits for its predecessors, a resubmitted one (the SDK retries) gets the
  first one's request id and runs once. A predecessor that never arrives fails the waiting
  requests after ``gap_timeout_s`` instead of hanging them. A request whose run can lead the one
  queued after it (``with_next``: a forward_backward and its optim_step,
  :mod:`otray.tinker.service.train_runs`) runs with it as one call, each still answered alone.
  A training call (an :class:`Ahead` run) is sent while the one before it is still on the learner,
  up to ``ahead`` unanswered (``scheduling.calls_ahead``, :mod:`otray.tinker.service.handover`);
  answers are still given in order, and any other request waits until those before it are answered.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence

from otray.tinker.service.timeline import Timeline
from otray.tinker.errors import UserError


@dataclass
class Outcome:
    """A finished request: ``json`` (a dict), ``proto`` (bytes of the protobuf ``message``, e.g.
    ``SampleResponse``: the gateway answers JSON clients with its JSON form) or ``error`` (message, category)."""

    kind: str
    body: Any
    message: str = ""

    @staticmethod
    def error(message: str, category: str = "user") -> "Outcome":
        return Outcome("error", {"error": message, "category": category})


@dataclass
class _Entry:
    owner: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Optional[Outcome] = None
    finished: float = 0.0


def failed(e: Exception) -> Outcome:
    """A request's outcome when its run raised ``e``: a UserError is a ``user`` error, any other a ``server`` one."""
    if isinstance(e, UserError):
        return Outcome.error(str(e))
    return Outcome.error(f"{type(e).__name__}: {e}"[:2000], "server")


async def settle(run: Callable[[], Awaitable[Outcome]]) -> Outcome:
    """``run()``'s outcome, or what it raised as :func:`failed` answers it."""
    try:
        return await run()
    except Exception as e:  # noqa: BLE001 - reported to the caller
        return failed(e)


async def settle_pair(run: Callable[[], Awaitable[tuple[Outcome, Outcome]]]) -> tuple[Outcome, Outcome]:
    """Two requests run as one (each answered by ``run()``); what it raises, as :func:`failed` answers it, for both."""
    try:
        return await run()
    except Exception as e:  # noqa: BLE001 - the shared call failed: both requests with its outcome
        return failed(e), failed(e)


class Futures:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.items: dict[str, _Entry] = {}
        self.open: dict[str, int] = {}  # owner -> requests not finished (quota.concurrent_requests)
        self.on_finish: Optional[Callable[[str, Outcome], None]] = None  # told of every finished request
        self.timeline = Timeline()  # each session's requests, for export_session_trace

    def new(self, request_id: str, owner: str, kind: str = "request") -> bool:
        """Register a request (``kind``: what it asks, for the session's timeline); False when it exists
        already (a resubmission)."""
        self._expire()
        if request_id in self.items:
            return False
        self.items[request_id] = _Entry(owner)
        self.timeline.opened(request_id, kind)
        self.open[owner] = self.open.get(owner, 0) + 1
        return True

    def room(self, owner: str, limit: int) -> None:
        """Refuse a new request of ``owner``, who has ``limit`` unfinished ones already: a 429 (the SDK
        waits and sends it again, so only this user's client slows down)."""
        if self.open.get(owner, 0) >= limit:
            raise UserError(f"quota: {owner} has {self.open[owner]} requests not finished yet, the limit is {limit} "
                            "(quota.concurrent_requests); wait for results before sending more, or ask an admin", 429)

    def finish(self, request_id: str, outcome: Outcome) -> None:
        entry = self.items.get(request_id)
        if entry is not None and entry.outcome is None:
            entry.outcome, entry.finished = outcome, time.monotonic()
            self.open[entry.owner] -= 1
            self.timeline.closed(request_id, f"{outcome.body['category']} error" if outcome.kind == "error" else "ok")
            entry.done.set()
            if self.on_finish is not None:
                self.on_finish(request_id, outcome)

    def owner(self, request_id: str) -> Optional[str]:
        entry = self.items.get(request_id)
        return entry.owner if entry else None

    async def wait(self, request_id: str, owner: str, timeout: float) -> Optional[Outcome]:
        """The outcome, or None when it is not in within ``timeout`` seconds (answer: try again)."""
        entry = self.items.get(request_id)
        if entry is None or entry.owner != owner:
            raise UserError(f"no request {request_id!r} (unknown, another user's, or its result expired "
                            f"{self.ttl_s:.0f} s after it finished)", 404)
        try:
            await asyncio.wait_for(entry.done.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return entry.outcome

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for rid in [r for r, e in self.items.items() if e.outcome is not None and e.finished < cutoff]:
            del self.items[rid]


class Ahead(Protocol):
    """A run whose call may be sent before the requests before it are answered (a training call: the learner runs
    a model's calls in the order they came, :mod:`otray.tinker.service.handover`)."""

    def may_follow(self, ahead: Sequence[Any]) -> bool:
        """Whether it may be sent while the runs ``ahead`` (sent before it, in order) are unanswered."""

    async def send(self, ahead: Sequence[Any]) -> Callable[[], Awaitable[Any]]:
        """Its call sent, behind ``ahead``'s; returns what answers it (an Outcome; a pair's run, two)."""


@dataclass
class _Queue:
    next_seq: int = 1  # the next request to run (or send)
    pending: dict[int, tuple[str, Callable[[], Awaitable[Outcome]]]] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id (resubmissions)
    running: bool = False
    ahead: deque[tuple[Any, asyncio.Task]] = field(default_factory=deque)  # runs sent, each with what answers it
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set as each request is queued


class OrderedExecutor:
    """Each model's requests in ``seq_id`` order (``ahead``: its :class:`Ahead` runs sent and not answered yet, at
    most; 1: each run when the last is answered)."""

    def __init__(self, futures: Futures, gap_timeout_s: float, ahead: int):
        self.futures = futures
        self.gap_timeout_s = gap_timeout_s
        self.ahead = ahead
        self.queues: dict[str, _Queue] = {}
        self.sent_ahead = 0  # runs sent while one before them was unanswered, since the start

    def start(self, model_id: str, next_seq: int = 1) -> None:
        """A new model whose first queued request will be ``next_seq``."""
        self.queues[model_id] = _Queue(next_seq=next_seq)

    def forget(self, model_id: str, why: str = "the model was unloaded") -> None:
        """Stop ordering ``model_id``'s requests; those still waiting fail (user category) with ``why``."""
        q = self.queues.pop(model_id, None)
        if q is not None:
            for request_id, _ in q.pending.values():
                self.futures.finish(request_id, Outcome.error(f"{model_id}: {why}"))
            q.pending.clear()

    def submit(self, model_id: str, seq_id: int, owner: str, run: Callable[[], Awaitable[Outcome]],
               kind: str = "request") -> str:
        """Queue ``run`` as request ``seq_id`` of ``model_id`` (``kind``: what it asks); returns its request id."""
        q = self.queues.get(model_id)
        if q is None:
            raise UserError(f"no model {model_id!r} is loaded here (create it, or load a checkpoint)", 404)
        if seq_id in q.seen:
            return q.seen[seq_id]
        if seq_id < q.next_seq:
            raise UserError(f"{model_id}: seq_id {seq_id} was already used and its request expired; the next "
                            f"request of this model is seq_id {q.next_seq}")
        request_id = f"{model_id}:req:{seq_id}"
        self.futures.new(request_id, owner, kind)
        q.seen[seq_id] = request_id
        q.pending[seq_id] = (request_id, run)
        q.arrived.set()
        if seq_id > q.next_seq:
            asyncio.get_running_loop().call_later(self.gap_timeout_s, self._gap, model_id, q.next_seq)
        if not q.running:
            q.running = True
            asyncio.get_running_loop().create_task(self._drain(q))
        return request_id

    def counts_against_quota(self, model_id: str, seq_id: int) -> bool:
        """Whether request ``seq_id`` of ``model_id`` is a new one that is not the model's next: a
        resubmission is the same request, and the next one is always let in (the requests waiting
        for it hold their owner's quota: refusing it would leave them waiting for ever)."""
        q = self.queues.get(model_id)
        return q is not None and seq_id not in q.seen and seq_id != q.next_seq

    def refuse(self, model_id: str, seq_id: int, owner: str, message: str) -> None:
        """Request ``seq_id`` was refused before it was queued (bad input): it takes its place in the order
        as a request that fails with ``message``, so the requests after it run at once instead of waiting
        ``gap_timeout_s`` for it."""
        q = self.queues.get(model_id)
        if q is None or seq_id in q.seen or seq_id < q.next_seq:
            return

        async def refused() -> Outcome:
            return Outcome.error(message)

        self.submit(model_id, seq_id, owner, refused, "refused")

    async def _drain(self, q: _Queue) -> None:
        try:
            while q.next_seq in q.pending:
                await self._room(q, q.pending[q.next_seq][1])
                if q.next_seq not in q.pending:  # the model was forgotten meanwhile
                    break
                ids, run = self._unit(q)
                if hasattr(run, "send"):  # sent now, answered in order once those before it are
                    try:
                        answer = await run.send([r for r, _ in q.ahead])
                    except Exception as e:  # noqa: BLE001 - refused before it was sent (its lease check)
                        answer = raising(e)
                    before = q.ahead[-1][1] if q.ahead else None
                    self.sent_ahead += before is not None and not before.done()
                    q.ahead.append((run, asyncio.ensure_future(self._answer(ids, answer, before))))
                else:
                    await self._answer(ids, run, None)
                for old in [s for s in q.seen if s < q.next_seq - 1000]:
                    del q.seen[old]
        finally:
            q.running = False

    async def _room(self, q: _Queue, run: Any) -> None:
        """Wait until ``run`` may go: the runs sent and not answered yet are fewer than ``ahead``, and ``run`` is one
        that may be sent ahead of them (:class:`Ahead`), else there are none."""
        while q.ahead:
            oldest = q.ahead[0][1]
            if oldest.done():
                q.ahead.popleft()
            elif not hasattr(run, "send") or len(q.ahead) >= self.ahead or not run.may_follow([r for r, _ in q.ahead]):
                await asyncio.wait([oldest])
            elif getattr(run, "leads", False) and q.next_seq + 1 not in q.pending:
                # a forward_backward whose optim_step may be on its way: the two go as one if it comes before the
                # learner needs work (the run before answered)
                q.arrived.clear()
                came = asyncio.ensure_future(q.arrived.wait())
                await asyncio.wait([came, oldest], return_when=asyncio.FIRST_COMPLETED)
                came.cancel()
            else:
                return

    def _unit(self, q: _Queue) -> tuple[list[str], Any]:
        """The next request's run, with the queued one after it when it leads it (``with_next``: one run answering
        both); their request ids."""
        request_id, run = q.pending.pop(q.next_seq)
        follower = q.pending.get(q.next_seq + 1)
        pair = run.with_next(follower[1]) if follower is not None and hasattr(run, "with_next") else None
        ids = [request_id] if pair is None else [request_id, q.pending.pop(q.next_seq + 1)[0]]
        q.next_seq += len(ids)
        for rid in ids:
            self.futures.timeline.running(rid)
        return ids, run if pair is None else pair

    async def _answer(self, ids: list[str], run: Callable[[], Awaitable[Any]], before: Optional[asyncio.Task]) -> None:
        """``run()``'s outcome (a pair's two) given to requests ``ids``, once ``before`` (the request before) was."""
        if before is not None:
            await asyncio.wait([before])
        outcomes = [await settle(run)] if len(ids) == 1 else await settle_pair(run)
        for rid, outcome in zip(ids, outcomes):
            self.futures.finish(rid, outcome)

    def _gap(self, model_id: str, missing: int) -> None:
        q = self.queues.get(model_id)
        if q is None or q.next_seq != missing or missing in q.pending or not q.pending:
            return
        message = (f"{model_id}: request seq_id {missing} never arrived within gap_timeout_s={self.gap_timeout_s:.0f}; "
                   "requests after it cannot run in order")

        async def fail() -> Outcome:
            return Outcome.error(message)

        request_id = f"{model_id}:req:{missing}"
        owner = self.futures.owner(next(iter(q.pending.values()))[0]) or ""  # the model's: a late send reads it
        self.futures.new(request_id, owner, "missing")
        q.seen[missing] = request_id
        q.pending[missing] = (request_id, fail)
        if not q.running:
            q.running = True
            asyncio.get_running_loop().create_task(self._drain(q))


def raising(e: Exception) -> Callable[[], Awaitable[Any]]:
    """A run that raises ``e``."""

    async def run() -> Any:
        raise e
    return run
