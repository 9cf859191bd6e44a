"""Each session's request timeline, and its export as a trace (``RestClient.export_session_trace``).

:class:`Timeline` is held by :class:`~otray.tinker.service.futures.Futures`, which tells it when a request of a
session arrives (``opened``), when its model's turn starts running it (``running``: training requests
wait for their predecessors in ``seq_id`` order) and when its result is in (``closed``, with how it
ended). Requests are grouped by the session their id names (``{session}:train:{n}:req:{seq}``,
``sample:{session}:sampler:{n}:{seq}``, ...); the newest ``max_spans`` of a session and the newest
``max_sessions`` sessions are kept, in memory only (a restarted service starts a new timeline).

:func:`chrome_trace` writes one session's spans in the Trace Event Format (JSON), which
https://ui.perfetto.dev and chrome://tracing open: one track per training client or sampler, a slice
per request from its arrival to its result, and inside it the part its model spent running it.

Runs in the TinkerService actor."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from typing import Optional


@dataclass
class Span:
    request_id: str
    kind: str  # forward_backward, optim_step, sample, save_weights, ...
    start: float  # wall-clock seconds
    running: Optional[float] = None
    end: Optional[float] = None
    outcome: str = "pending"  # ok, user error, server error, pending
    notes: Optional[dict] = None  # what else the service recorded about it (e.g. the weights version sampled)


class Timeline:
    def __init__(self, max_spans: int = 20_000, max_sessions: int = 1_000):
        self.max_spans, self.max_sessions = max_spans, max_sessions
        self.sessions: collections.OrderedDict[str, collections.deque[Span]] = collections.OrderedDict()
        self.open: dict[str, Span] = {}  # request id -> its span, until closed

    def opened(self, request_id: str, kind: str) -> None:
        within = _within(request_id)
        if ":" not in within or request_id in self.open:
            return  # a request of no session (a base model sampled without one), or a resubmission
        session = within.split(":")[0]
        if session not in self.sessions:
            if len(self.sessions) >= self.max_sessions:
                self.sessions.popitem(last=False)
            self.sessions[session] = collections.deque(maxlen=self.max_spans)
        self.sessions.move_to_end(session)
        span = Span(request_id, kind, time.time())
        self.sessions[session].append(span)
        self.open[request_id] = span

    def running(self, request_id: str) -> None:
        span = self.open.get(request_id)
        if span is not None:
            span.running = time.time()

    def note(self, request_id: str, key: str, value: object) -> None:
        """Record ``key = value`` on an open request's span (shown in the trace's args)."""
        span = self.open.get(request_id)
        if span is not None:
            span.notes = {**(span.notes or {}), key: value}

    def closed(self, request_id: str, outcome: str) -> None:
        span = self.open.pop(request_id, None)
        if span is not None:
            span.end, span.outcome = time.time(), outcome

    def spans(self, session: str) -> list[Span]:
        return list(self.sessions.get(session, ()))


def _within(request_id: str) -> str:
    """A request id without the ``sample:`` a sample request's id starts with."""
    return request_id.removeprefix("sample:")


def _track(request_id: str) -> str:
    """The training client or sampler a request belongs to: its id up to the request's own number."""
    request_id = _within(request_id)
    head = request_id.rsplit(":req:", 1)[0] if ":req:" in request_id else request_id.rsplit(":", 1)[0]
    return head.split(":", 1)[1] if ":" in head else head


def chrome_trace(session: str, spans: list[Span], now: Optional[float] = None) -> bytes:
    """``spans`` of ``session`` as Trace Event Format JSON (times in microseconds from the first span)."""
    now = time.time() if now is None else now
    origin = min((s.start for s in spans), default=now)
    tracks = {t: i + 1 for i, t in enumerate(dict.fromkeys(_track(s.request_id) for s in spans))}
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"session {session}"}}]
    events += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": track}}
               for track, tid in tracks.items()]

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 1)

    for s in spans:
        end, tid = s.end if s.end is not None else now, tracks[_track(s.request_id)]
        args = {"request_id": s.request_id, "outcome": s.outcome,
                "queued_ms": round(((s.running or end) - s.start) * 1e3, 3), **(s.notes or {})}
        events.append({"ph": "X", "pid": 1, "tid": tid, "name": s.kind, "ts": us(s.start),
                       "dur": max(us(end) - us(s.start), 0.0), "args": args})
        if s.running is not None:
            events.append({"ph": "X", "pid": 1, "tid": tid, "name": "running", "ts": us(s.running),
                           "dur": max(us(end) - us(s.running), 0.0)})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"session_id": session, "exported_at": now}}).encode()
