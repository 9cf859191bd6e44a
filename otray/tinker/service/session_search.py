"""``search_sessions``: a user's sessions filtered as SDK 0.38's ``SessionSearchRequest`` says, newest first,
one page at a time.

A session's search fields are what its ``create_session`` carried (``display_name``, ``user_metadata``,
``project_id``) and its status: ``active`` while open, ``client_finished`` with the reason its client's
``close()`` gave, none once it expired without one (:mod:`otray.tinker.service.sessions`). Sessions are private:
``owner: accessible`` finds the caller's own (no other user's session is accessible here) and ``owner:
user`` finds them only where its ``owner_urns`` name the caller. Projects are labels (otray has no
projects or project permissions): a session without one is in ``default``.

Runs in the TinkerService actor."""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable

from otray.tinker.service.store import SessionInfo
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import SearchSessions

DEFAULT_PROJECT = "default"
STATUS_TYPES = ("active", "cancelled", "failed", "client_finished")


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="microseconds")


def _field(req: SearchSessions, key: str, kind: type) -> Any:
    value = getattr(req, key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise UserError(f"search_sessions: {key} must be a {kind.__name__}, got {str(value)[:80]}")
    return value


def _status_matches(status: Any, queries: list[Any]) -> bool:
    for q in queries:
        if not isinstance(q, dict) or q.get("type") not in STATUS_TYPES:
            raise UserError(f"search_sessions: a status query must be one of {list(STATUS_TYPES)}, got {str(q)[:80]}")
        if status is None or status.get("type") != q["type"]:
            continue
        reasons = q.get("reasons")
        if q["type"] != "client_finished" or not reasons or status["reason"]["type"] in reasons:
            return True
    return False


def search(owner: str, infos: list[SessionInfo], req: SearchSessions,
           stats: Callable[[str], tuple[int, int]]) -> dict[str, Any]:
    """One page of ``owner``'s sessions (``infos``) matching ``req``; ``stats(session_id)`` gives a
    session's (checkpoint count, bytes)."""
    limit = _field(req, "limit", int)
    if not 1 <= limit <= 200:
        raise UserError(f"search_sessions: limit must be 1 to 200, got {limit}")
    who = _field(req, "owner", dict) or {"type": "own"}
    if who.get("type") not in ("own", "accessible", "user"):
        raise UserError(f"search_sessions: owner must be own, accessible or user, got {str(who)[:80]}")
    if who["type"] == "user" and f"tml:user:{owner}" not in (who.get("owner_urns") or []):
        infos = []  # another user's sessions are not searchable here
    sid, name = _field(req, "session_id", str), _field(req, "display_name", str)
    projects, meta = _field(req, "project_ids", list), _field(req, "user_metadata", dict) or {}
    statuses = _field(req, "statuses", list)

    def matches(i: SessionInfo) -> bool:
        words = name.lower().split() if name else []
        named = (sid is None and not words) or i.session_id == sid or bool(
            words and i.display_name and all(w in i.display_name.lower() for w in words))
        return (named and (projects is None or (i.project_id or DEFAULT_PROJECT) in projects)
                and all((i.user_metadata or {}).get(k) == v for k, v in meta.items())
                and (statuses is None or _status_matches(i.status, statuses)))

    rows = sorted((i for i in infos if matches(i)), key=lambda i: (round(i.created, 6), i.session_id), reverse=True)
    cursor = _field(req, "cursor", dict)
    if cursor is not None:
        try:
            after = (round(dt.datetime.fromisoformat(cursor["last_created_at"]).timestamp(), 6), cursor["last_session_id"])
        except (KeyError, TypeError, ValueError):
            raise UserError("search_sessions: cursor must be a previous answer's next_cursor, unchanged") from None
        rows = [i for i in rows if (round(i.created, 6), i.session_id) < after]
    page = rows[:limit]
    last = page[-1] if len(rows) > limit else None
    return {"sessions": [summary(i, *stats(i.session_id)) for i in page],
            "next_cursor": last and {"last_created_at": _iso(last.created), "last_session_id": last.session_id}}


def summary(i: SessionInfo, checkpoints: int, size: int) -> dict[str, Any]:
    """The SDK's ``SessionSummary`` of one session."""
    return {"session_id": i.session_id, "created_at": _iso(i.created), "owner": f"tml:user:{i.owner}",
            "project_id": i.project_id or DEFAULT_PROJECT, "status": i.status, "checkpoints_count": checkpoints,
            "display_name": i.display_name, "user_metadata": i.user_metadata, "checkpoint_storage_bytes": size}
