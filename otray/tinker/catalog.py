"""The Tinker service's owner-checked lookups and read-only views over its store: a caller gets
only their own runs, checkpoints and samplers, and another user's id is answered like an unknown
one (404)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

from otray.tinker import runs as R
from otray.tinker.store import Checkpoint, Run, Sampler, Store, parse_path
from otray.tinker.wire import UserError


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


# A read-only REST call (or a checkpoint's deletion), typed: the gateway sends one, the service answers it.
RestQuery = Union[SamplerView, RunsView, RunView, CheckpointsView, DeleteCheckpoint, WeightsInfoView]


class Catalog:
    def __init__(self, store: Store):
        self.store = store

    def run(self, owner: str, model_id: str) -> Run:
        run = self.store.run(model_id)
        if run is None or run.owner != owner:
            raise UserError(f"no training run {model_id!r} (unknown, or another user's)", 404)
        return run

    def checkpoint(self, owner: str, path: str) -> Checkpoint:
        model_id, kind, name = parse_path(path)
        ckpt = self.store.checkpoint(model_id, kind, name)
        run = self.store.run(model_id)
        if ckpt is None or run is None or run.owner != owner or (ckpt.expires and ckpt.expires < time.time()):
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
        raise UserError(f"no REST view {type(q).__name__}", 404)

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
        return R.weights_info(self.store.run(self.checkpoint(owner, path).model_id))

    def get_sampler(self, owner: str, sampler_id: str) -> dict[str, Any]:
        s = self.sampler(owner, sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}
