"""The Tinker service's sessions: one per ``ServiceClient``, kept open by its heartbeats.

:class:`Sessions` is owned by :class:`~otray.tinker.service.tinker_service.TinkerService`. A session whose client
stops heartbeating for ``timeout_s`` is closed like one the SDK finished: its training clients leave
the learner and their leases end (``on_close``). Session ids are kept in the service's SQLite store
while open, so after a restart the same ``ServiceClient`` goes on: its owner's next call takes the
session up again (its live models are gone; it loads their checkpoints). It also counts each
user's sampling clients in open sessions (``quota.samplers``).

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Awaitable, Callable, Optional

from otray.tinker.service.store import SessionInfo, Store
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import CreateSession

FINISH_REASONS = ("success", "errored", "interrupted")  # the SDK's close() statuses


def _text(value: Any, limit: int = 500) -> Optional[str]:
    return value[:limit] if isinstance(value, str) and value else None


class Sessions:
    def __init__(self, store: Store, timeout_s: float, on_close: Callable[[str], Awaitable[None]]):
        self.store, self.timeout_s, self.on_close = store, timeout_s, on_close
        self.open: dict[str, tuple[str, float]] = {}  # session id -> (owner, last heartbeat)
        self.samplers: dict[str, tuple[str, str]] = {}  # sampling client id -> (owner, session)

    def new(self, owner: str, req: Optional[CreateSession] = None) -> str:
        """A session for ``owner``; ``req``: the create_session body (display_name, user_metadata, project_id:
        kept for search_sessions)."""
        req = req or CreateSession()
        sid = f"s-{uuid.uuid4().hex[:16]}"
        self.open[sid] = (owner, time.monotonic())
        self.store.add_session(sid, owner)
        meta = req.user_metadata
        self.store.add_session_info(SessionInfo(
            sid, owner, time.time(), _text(req.display_name), {str(k): str(v) for k, v in meta.items()}
            if isinstance(meta, dict) else None, _text(req.project_id), {"type": "active"}))
        return sid

    def check(self, owner: str, session_id: str) -> None:
        """``owner``'s open session, or a 404. One open when the service stopped (in the store) is
        taken up again by its owner's call."""
        if session_id not in self.open and isinstance(session_id, str) and self.store.session_owner(session_id) == owner:
            self.open[session_id] = (owner, time.monotonic())
        s = self.open.get(session_id)
        if s is None or s[0] != owner:
            raise UserError(f"no session {session_id!r} (it was closed, expired after {self.timeout_s:.0f} s "
                            "without heartbeats, or is another user's)", 404)

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.check(owner, session_id)
        self.open[session_id] = (owner, time.monotonic())

    async def finish(self, owner: str, session_id: str, reason: Any = None, detail: Any = None) -> None:
        """The SDK's ``close(reason, detail)``: its status becomes ``client_finished`` with that reason."""
        self.check(owner, session_id)
        kind = reason.get("type") if isinstance(reason, dict) else None
        self.store.update_session_info(session_id, status={
            "type": "client_finished", "reason": {"type": kind if kind in FINISH_REASONS else "success"},
            "detail": _text(detail)})
        self.open[session_id] = (owner, float("-inf"))
        await self.expire()

    def add_sampler(self, owner: str, session_id: str, sampler_id: str, limit: int) -> None:
        """A sampling client of ``owner``'s, refused past ``limit`` in their open sessions (403)."""
        if sampler_id not in self.samplers:
            mine = sum(1 for who, s in self.samplers.values() if who == owner and s in self.open)
            if mine >= limit:
                raise UserError(f"quota: {owner} holds {mine} sampling clients in open sessions, the limit is {limit} "
                                "(quota.samplers); close a session (ServiceClient) or ask an admin for more", 403)
        self.samplers[sampler_id] = (owner, session_id)

    async def sweep(self) -> None:
        """Expire silent sessions even when no new session comes (a task for the service's life)."""
        while True:
            await asyncio.sleep(max(1.0, self.timeout_s / 4))
            await self.expire()

    async def expire(self) -> None:
        """Close the sessions whose client stopped heartbeating (or finished)."""
        cutoff = time.monotonic() - self.timeout_s
        for sid, (_, seen) in [(s, v) for s, v in self.open.items() if v[1] < cutoff]:
            if seen != float("-inf"):  # expired, not finished by its client: its status is unknown
                self.store.update_session_info(sid, status=None)
            del self.open[sid]
            self.store.drop_session(sid)
            for sampler in [k for k, (_, s) in self.samplers.items() if s == sid]:
                del self.samplers[sampler]
            await self.on_close(sid)
