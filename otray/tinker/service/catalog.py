"""The Tinker service's owner-checked lookups and read-only views over its store: a caller gets
only their own runs, checkpoints and samplers, and another user's id is answered like an unknown
one (404).

Runs in the TinkerService actor; the gateway builds its typed queries."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from otray.tinker.service import external as X
from otray.tinker.service import session_search
from otray.tinker.service import runs as R
from otray.tinker.service.store import Checkpoint, Run, Sampler, Store, link_tree, parse_path, session_of
from otray.tinker.service.timeline import Timeline, chrome_trace
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import SearchSessions


@dataclass(frozen=True)
class SamplerView:
    sampler_id: str


@dataclass(frozen=True)
class RunsView:
    limit: int
    offset: int


@dataclass(frozen=True)
class RunView:
    model_id: str


@dataclass(frozen=True)
class CheckpointsView:
    model_id: str


@dataclass(frozen=True)
class DeleteCheckpoint:
    model_id: str
    checkpoint_id: str


@dataclass(frozen=True)
class WeightsInfoView:
    tinker_path: str


@dataclass(frozen=True)
class UserCheckpointsView:
    """``list_user_checkpoints``: every checkpoint of the caller's runs, newest first."""

    limit: int
    offset: int


@dataclass(frozen=True)
class Publish:
    """``publish`` / ``unpublish``: a published checkpoint is readable by every user (by its path)."""

    model_id: str
    checkpoint_id: str
    public: bool


@dataclass(frozen=True)
class SetTtl:
    """``set_checkpoint_ttl``: expire ``ttl_seconds`` from now (None: never); expired ones are deleted."""

    model_id: str
    checkpoint_id: str
    ttl_seconds: Optional[float]


@dataclass(frozen=True)
class SessionsView:
    limit: int
    offset: int


@dataclass(frozen=True)
class SessionView:
    session_id: str


# A REST call on the index (reads, and a checkpoint's deletion, publication or TTL), typed: the
# gateway sends one, the service answers it.
@dataclass(frozen=True)
class ExternalUrls:
    """``get_external_weights_urls``: a signed token per file of an external weights export."""

    model_id: str
    checkpoint_id: str


@dataclass(frozen=True)
class CopyWeights:
    """``copy_weights``: a readable checkpoint (the caller's, or a published one) copied into a new run of the
    caller's that cannot be trained (``model_id``: ``{session}:train:{n}`` when a session asked, else a fresh
    id; ``project``: kept as the run's label, otray has no projects). ``key``: the SDK's idempotency key."""

    source_path: str
    model_id: str
    session_id: Optional[str]  # the session asking (checked open and the caller's), or None
    ttl_seconds: Optional[float]
    project: Optional[str]
    key: Optional[str]


@dataclass(frozen=True)
class SessionSearch:
    """``search_sessions``: the SDK's SessionSearchRequest (its values checked in session_search.py)."""

    request: SearchSessions


@dataclass(frozen=True)
class SessionProject:
    """``assign_session_project``: the caller's session labelled with ``project_id``."""

    session_id: str
    project_id: Any


@dataclass(frozen=True)
class TraceExport:
    """``export_session_trace``: the caller's session's timeline (timeline.py), written as a file whose
    signed token is the answer."""

    session_id: str


@dataclass(frozen=True)
class JoinSampler:
    """``join_sampling_session``: a copy of a sampling client (pickled, or from a sampler handle) asks for
    its number among the session's clients; its request ids are made from it."""

    sampler_id: Optional[str]


@dataclass(frozen=True)
class StorageUsage:
    """``get_current_checkpoint_storage_usage``: the caller's checkpoint files now (the quota's measure)."""


RestQuery = Union[SamplerView, RunsView, RunView, CheckpointsView, DeleteCheckpoint, WeightsInfoView,
                  UserCheckpointsView, Publish, SetTtl, SessionsView, SessionView, ExternalUrls, StorageUsage,
                  SessionSearch, SessionProject, TraceExport, JoinSampler]
MAX_TTL_S = 10 * 365 * 24 * 3600  # Tinker's upper bound: ten years
TRACE = "trace"  # a signed file grant's "checkpoint" for a session's exported trace


class Catalog:
    def __init__(self, store: Store, min_ttl_s: float = 3600.0, secret: bytes = b"", url_ttl_s: float = 3600.0,
                 timeline: Optional[Timeline] = None):
        self.store, self.timeline = store, timeline or Timeline()
        self.secret, self.url_ttl_s = secret, url_ttl_s  # signed download URLs of external weights
        self.min_ttl_s = min_ttl_s  # the shortest TTL a user may set (Tinker: an hour)
        self.copies: dict[tuple[str, str], dict[str, str]] = {}  # (owner, idempotency key) -> the copy's answer

    def run(self, owner: str, model_id: str) -> Run:
        run = self.store.run(model_id)
        if run is None or run.owner != owner:
            raise UserError(f"no training run {model_id!r} (unknown, or another user's)", 404)
        return run

    def checkpoint(self, owner: str, path: str, *, read: bool = False, use: bool = False) -> Checkpoint:
        """``owner``'s checkpoint at ``path``; with ``read``, also another user's published one (to
        sample or load, never to change); with ``use`` (to sample or load it), not an external export."""
        model_id, kind, name = parse_path(path)
        if use and kind == "external":
            raise UserError(f"{path!r} is an external weights export, for download (RestClient."
                            "get_external_weights_urls); load or sample a weights/ or sampler_weights/ checkpoint")
        ckpt = self.store.checkpoint(model_id, kind, name)
        run = self.store.run(model_id)
        mine = run is not None and (run.owner == owner or (read and ckpt is not None and ckpt.public))
        if ckpt is None or not mine or (ckpt.expires and ckpt.expires < time.time()):
            raise UserError(f"no checkpoint {path!r} (unknown, deleted, expired, or another user's)", 404)
        return ckpt

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        s = self.store.sampler(sampler_id)
        if s is None or s.owner != owner:
            raise UserError(f"no sampling session {sampler_id!r} (unknown, or another user's)", 404)
        return s

    # ------------------------------------------------------------------ REST views

    def answer(self, owner: str, q: RestQuery) -> Any:
        """The REST view ``q`` asks for, as ``owner`` may see it."""
        if isinstance(q, SamplerView):
            return self.get_sampler(owner, q.sampler_id)
        if isinstance(q, RunsView):
            return self.training_runs(owner, q.limit, q.offset)
        if isinstance(q, RunView):
            return self.training_run(owner, q.model_id)
        if isinstance(q, CheckpointsView):
            return self.checkpoints(owner, q.model_id)
        if isinstance(q, DeleteCheckpoint):
            return self.delete_checkpoint(owner, q.model_id, q.checkpoint_id)
        if isinstance(q, WeightsInfoView):
            return self.weights_info(owner, q.tinker_path)
        if isinstance(q, UserCheckpointsView):
            found = [c for c in self.store.user_checkpoints(owner) if not c.name.startswith("ephemeral-")]
            return {"checkpoints": [R.checkpoint_json(c) for c in found[q.offset:q.offset + q.limit]],
                    "cursor": {"offset": q.offset, "limit": q.limit, "total_count": len(found)}}
        if isinstance(q, Publish):
            self.store.update_checkpoint(self.checkpoint(owner, f"tinker://{q.model_id}/{q.checkpoint_id}"), public=q.public)
            return None
        if isinstance(q, SetTtl):
            return self.set_ttl(owner, q)
        if isinstance(q, SessionsView):
            return {"sessions": self.store.sessions(owner)[q.offset:q.offset + q.limit]}
        if isinstance(q, SessionView):
            return self.session(owner, q.session_id)
        if isinstance(q, ExternalUrls):
            return self.external_urls(owner, q)
        if isinstance(q, SessionSearch):
            return session_search.search(owner, self.store.session_infos(owner), q.request, lambda sid: self._stats(owner, sid))
        if isinstance(q, SessionProject):
            return self.assign_project(owner, q)
        if isinstance(q, TraceExport):
            return self.trace(owner, q.session_id)
        if isinstance(q, JoinSampler):
            if not isinstance(q.sampler_id, str):
                raise UserError("join_sampling_session: send the sampling_session_id to join")
            return {"type": "join_sampling_session",
                    "client_counter": self.store.next_clone(self.sampler(owner, q.sampler_id).sampler_id)}
        if isinstance(q, StorageUsage):
            size = self.store.usage(owner)
            return {"data": [{"org_user_urn": f"tml:user:{owner}", "user_name": owner, "size_bytes": size,
                              "checkpoint_count": len(self.store.user_checkpoints(owner)), "size_gigabytes": size / 1e9}]}
        raise UserError(f"no REST view {type(q).__name__}", 404)

    def copy(self, owner: str, q: CopyWeights) -> dict[str, str]:
        """Copy a checkpoint's files by hard links (no bytes duplicated; either copy's deletion or expiry leaves
        the other whole) into a new run of ``owner``'s; the copy keeps its kind and name, not its expiry."""
        if q.key and (owner, q.key) in self.copies:
            return self.copies[(owner, q.key)]  # the SDK retried: one copy
        src = self.checkpoint(owner, q.source_path, read=True)
        self.check_ttl(q.ttl_seconds)
        if self.store.run(q.model_id) is not None:
            raise UserError(f"training run {q.model_id!r} exists already; copy into a new model_seq_id", 409)
        source = self.store.run(src.model_id)
        dest = self.store.checkpoint_dir(owner, q.model_id, src.kind, src.name)
        link_tree(src.path, dest)
        self.store.add_run(q.model_id, owner, source.base_model, {**source.spec, "copied_from": src.tinker_path},
                           {"project_id": q.project} if q.project else None)
        copy = Checkpoint(q.model_id, src.kind, src.name, str(dest), time.time(), src.size,
                          None if q.ttl_seconds is None else time.time() + q.ttl_seconds, src.user_metadata)
        self.store.add_checkpoint(copy)
        self.copies[(owner, q.key or copy.tinker_path)] = {"tinker_path": copy.tinker_path}
        return {"tinker_path": copy.tinker_path}

    def check_ttl(self, ttl_seconds: Optional[float]) -> None:
        if ttl_seconds is not None and not self.min_ttl_s <= ttl_seconds <= MAX_TTL_S:
            raise UserError(f"ttl_seconds={ttl_seconds:g} is out of range: send {self.min_ttl_s:g} to {MAX_TTL_S} "
                            "seconds, or null for no expiry")

    async def sweep_expired(self, every_s: float) -> None:
        """Delete expired checkpoints, rows and files, every ``every_s`` (a TTL is a promise to free the space)."""
        while True:
            for c in self.store.expired(time.time()):
                self.store.delete_checkpoint(c.model_id, c.kind, c.name)
                R.remove_dir(c.path)
            await asyncio.sleep(every_s)

    def set_ttl(self, owner: str, q: SetTtl) -> None:
        ckpt = self.checkpoint(owner, f"tinker://{q.model_id}/{q.checkpoint_id}")
        self.check_ttl(q.ttl_seconds)
        self.store.update_checkpoint(ckpt, expires=None if q.ttl_seconds is None else time.time() + q.ttl_seconds)

    def external_urls(self, owner: str, q: ExternalUrls) -> dict[str, Any]:
        """``{"files": {file: token}, "expires": epoch s}`` for one of ``owner``'s exports (or a published one)."""
        ckpt = self.checkpoint(owner, f"tinker://{q.model_id}/{q.checkpoint_id}", read=True)
        if ckpt.kind != "external":
            raise UserError(f"{ckpt.tinker_path} is not an external weights export: save one with "
                            "TrainingClient.save_weights_external(name), or merge it (POST /api/v1/merge_weights)")
        tokens, expires = {}, 0.0
        for name in X.files_of(Path(ckpt.path)):
            tokens[name], expires = X.sign(self.secret, X.FileGrant(ckpt.model_id, ckpt.checkpoint_id, name),
                                           self.url_ttl_s)
        return {"files": tokens, "expires": expires}

    def trace(self, owner: str, session_id: str) -> str:
        """A signed token for ``owner``'s session's timeline, written now (the newest export replaces the last)."""
        if session_id not in [i.session_id for i in self.store.session_infos(owner)]:
            raise UserError(f"no session {session_id!r} (unknown, or another user's)", 404)
        where = self.store.root / "traces" / f"{session_id}.json"
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_bytes(chrome_trace(session_id, self.timeline.spans(session_id)))
        return X.sign(self.secret, X.FileGrant(session_id, TRACE, where.name), self.url_ttl_s)[0]

    def external_file(self, token: str) -> bytes:
        """The file a signed URL names, while its checkpoint lives (no key: the token is the grant); or a
        session's exported trace."""
        grant = X.verify(self.secret, token)
        if grant.checkpoint_id == TRACE:
            where = self.store.root / "traces" / f"{grant.model_id}.json"
            if not where.is_file() or grant.file != where.name:
                raise UserError("no such trace (export it again)", 404)
            return where.read_bytes()
        model_id, kind, name = parse_path(f"tinker://{grant.model_id}/{grant.checkpoint_id}")
        ckpt = self.store.checkpoint(model_id, kind, name)
        if ckpt is None or (ckpt.expires and ckpt.expires < time.time()) or grant.file not in X.files_of(Path(ckpt.path)):
            raise UserError("no such file (its checkpoint was deleted or expired)", 404)
        return (Path(ckpt.path) / grant.file).read_bytes()

    def _stats(self, owner: str, session_id: str) -> tuple[int, int]:
        """A session's named checkpoints: how many, and their bytes."""
        found = [c for r in self.store.runs(owner) if session_of(r.model_id) == session_id
                 for c in self.store.checkpoints(r.model_id) if not c.name.startswith("ephemeral-")]
        return len(found), sum(c.size for c in found)

    def assign_project(self, owner: str, q: SessionProject) -> None:
        if q.session_id not in [i.session_id for i in self.store.session_infos(owner)]:
            raise UserError(f"no session {q.session_id!r} (unknown, or another user's)", 404)
        if not isinstance(q.project_id, str) or not 0 < len(q.project_id) <= 200:
            raise UserError("assign_session_project: project_id must be a name of 1 to 200 characters")
        self.store.update_session_info(q.session_id, project_id=q.project_id)

    def session(self, owner: str, session_id: str) -> dict[str, Any]:
        """A session's training runs and samplers; another user's or an unknown one is a 404."""
        if session_id not in self.store.sessions(owner):
            raise UserError(f"no session {session_id!r} (unknown, or another user's)", 404)
        runs = [r.model_id for r in self.store.runs(owner) if session_of(r.model_id) == session_id]
        samplers = [s.sampler_id for s in self.store.samplers(owner) if session_of(s.sampler_id) == session_id]
        info = [i for i in self.store.session_infos(owner) if i.session_id == session_id]
        return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": info[0].user_metadata if info else None}

    def checkpoints(self, owner: str, model_id: str) -> list[dict[str, Any]]:
        self.run(owner, model_id)
        return [R.checkpoint_json(c) for c in self.store.checkpoints(model_id) if not c.name.startswith("ephemeral-")]

    def delete_checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> None:
        ckpt = self.checkpoint(owner, f"tinker://{model_id}/{checkpoint_id}")
        self.store.delete_checkpoint(ckpt.model_id, ckpt.kind, ckpt.name)
        R.remove_dir(ckpt.path)

    def training_run(self, owner: str, model_id: str) -> dict[str, Any]:
        return R.run_json(self.run(owner, model_id), self.store.checkpoints(model_id))

    def training_runs(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        runs = self.store.runs(owner)
        page = runs[offset:offset + limit]
        return {"training_runs": [R.run_json(r, self.store.checkpoints(r.model_id)) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def weights_info(self, owner: str, path: str) -> dict[str, Any]:
        return R.weights_info(self.store.run(self.checkpoint(owner, path, read=True).model_id))

    def get_sampler(self, owner: str, sampler_id: str) -> dict[str, Any]:
        s = self.sampler(owner, sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

