"""``retrieve_futures``: one long poll per sampling session instead of one per sample request.

With ``sample_use_retrieve_futures`` in the client config, the SDK runs one poller per sampling
session (and per clone of it: ``cloned_sampler_id = seq_id // 1_000_000_000``) that asks
``/api/v1/retrieve_futures`` which of the session's requests finished since its cursor; a sample's
future waits for its id there, then fetches its result with ``retrieve_future`` as before. The poll
also acknowledges what the client saw (``prev_cursor``: events at or before it are dropped here) and
which results it has read (``retrieved_request_ids``).

A :class:`SessionFeeds` keeps, per (session, clone), the finished request ids in order with a cursor
(an integer that only grows), fed by the service's :class:`~otray.tinker.service.futures.Futures` when a
request of such a session finishes. Only the session's owner may poll it (the service checks).

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from otray.tinker.errors import UserError
from otray.tinker.wire.requests import ASample, RetrieveFutures

Target = tuple[str, int]  # (sampling session id, cloned sampler id)
MAX_WAIT_S = 30.0  # a long poll holds at most this long (the SDK's HTTP timeout is 45 s)


@dataclass
class _Feed:
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (cursor, completion)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def poll_args(req: RetrieveFutures) -> tuple[str, int, int, float | None]:
    """A ``retrieve_futures`` body as (sampling session id, clone, prev_cursor, timeout); a UserError if malformed."""
    target, prev, timeout = req.target, req.prev_cursor, req.timeout
    clone = target.get("cloned_sampler_id", 0) if isinstance(target, dict) else None
    if not isinstance(clone, int) or not isinstance(prev, int) or not isinstance(target.get("sampling_session_id"), str):
        raise UserError("retrieve_futures: send target {sampling_session_id, cloned_sampler_id} and an integer prev_cursor")
    return target["sampling_session_id"], clone, prev, timeout if isinstance(timeout, (int, float)) else None


class SessionFeeds:
    def __init__(self) -> None:
        self.watched: dict[str, Target] = {}  # request id -> the feed it reports to
        self.feeds: dict[Target, _Feed] = {}
        self.cursor = 0

    def watch(self, request_id: str, req: ASample) -> None:
        """Report ``request_id`` (the ``asample`` body ``req``) when it finishes, if it names a sampling session."""
        seq_id = req.seq_id
        if req.sampling_session_id:
            clone = seq_id // 1_000_000_000 if isinstance(seq_id, int) else 0
            self.watched[request_id] = (str(req.sampling_session_id), clone)

    def finished(self, request_id: str, outcome: Any) -> None:
        """A request finished (an :class:`~otray.tinker.service.futures.Outcome`): its feed, if any, gets the event."""
        target = self.watched.pop(request_id, None)
        if target is None:
            return
        self.cursor += 1
        ok = outcome.kind != "error"
        event: dict[str, Any] = {"state": "finished" if ok else "failed", "request_id": request_id}
        if outcome.kind == "proto":
            event["response_payload_uncompressed_size"] = len(outcome.body)
        feed = self.feeds.setdefault(target, _Feed())
        feed.events.append((self.cursor, event))
        feed.changed.set()

    async def poll(self, target: Target, prev_cursor: int, timeout: float | None) -> dict[str, Any]:
        """The completions after ``prev_cursor`` (those at or before it are dropped: seen), waiting up to
        ``timeout`` (None: the longest poll) for one when there is none yet."""
        feed = self.feeds.setdefault(target, _Feed())
        feed.events = [(c, e) for c, e in feed.events if c > prev_cursor]
        if not feed.events and timeout != 0:
            feed.changed.clear()
            try:
                await asyncio.wait_for(feed.changed.wait(), min(MAX_WAIT_S, timeout or MAX_WAIT_S))
            except asyncio.TimeoutError:
                pass
        cursor = feed.events[-1][0] if feed.events else max(prev_cursor, 0)
        return {"completions": [e for _, e in feed.events], "cursor": cursor}
