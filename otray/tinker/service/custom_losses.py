"""The custom losses of each session (``ServiceClient.create_custom_loss``), run server-side.

:class:`CustomLosses` is owned by :class:`~otray.tinker.service.tinker_service.TinkerService`. ``create`` checks the
uploaded graph (:func:`~otray.tinker.learner.loss_graph.parse_graph`: every node on the allow-list, or a 400
naming the one that is not), keeps its JSON in the service's SQLite store under ``{session}:loss:{n}``
(``n``: the SDK's ``custom_loss_seq_id``, so a retried upload gets the same id) and answers with a
finished promise of ``{loss_id}``. A ``forward_backward`` with loss ``custom`` names that id; only
the training clients of the session that created it may use it (another session's or user's id is a
404, as the SDK's own check says client-side). The losses go with their session (closed or expired),
and survive a service restart with it.

Runs in the TinkerService actor."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from otray.tinker.service.futures import Futures, Outcome
from otray.tinker.learner.loss_graph import LossGraph, parse_graph
from otray.tinker.service.sessions import Sessions
from otray.tinker.service.store import Store, session_of
from otray.tinker.config import CustomLossLimits
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import CreateCustomLoss, GraphUpload


class CustomLosses:
    """``limits``: what a loss may cost (``custom_losses``); ``storage_room(owner, bytes)``: refuses an upload
    past the owner's storage quota (a loss's JSON counts in it)."""

    def __init__(self, store: Store, futures: Futures, sessions: Sessions, served: bool = True,
                 limits: Optional[CustomLossLimits] = None, storage_room: Optional[Callable[[str, int], None]] = None):
        self.store, self.futures, self.sessions, self.served = store, futures, sessions, served
        self.limits = limits or CustomLossLimits()
        self.storage_room = storage_room
        self.graphs: dict[str, LossGraph] = {}  # parsed once per service life

    def create(self, owner: str, req: CreateCustomLoss) -> dict[str, Any]:
        """``create_custom_loss``: a promise (already finished) of the stored loss's id."""
        if not self.served:
            raise UserError("custom losses run client-side on this service (custom_loss_server_side: false); "
                            "forward_backward_custom runs them", 404)
        session = req.session_id
        self.sessions.check(owner, session)
        seq = req.custom_loss_seq_id
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError(f"custom_loss_seq_id must be an integer >= 0, got {seq!r}")
        graph = parse_graph(req.upload, self.limits)
        loss_id = f"{session}:loss:{seq}"
        body = json.dumps({"name": req.name, "inputs": req.inputs, "graph": req.graph})
        held, _ = self.store.losses_of(owner, besides=loss_id)  # (a retried upload replaces its row)
        if held >= self.limits.max_losses:
            raise UserError(f"quota: {owner} has {held} custom losses stored, the limit is {self.limits.max_losses} "
                            "(custom_losses.max_losses); they go with their sessions: close one", 403)
        if self.storage_room is not None:
            self.storage_room(owner, len(body))
        self.store.add_loss(loss_id, owner, body)
        self.graphs[loss_id] = graph
        request_id = f"{loss_id}:create"
        if self.futures.new(request_id, owner, "create_custom_loss"):
            self.futures.finish(request_id, Outcome("json", {"loss_id": loss_id, "type": "create_custom_loss"}))
        return {"request_id": request_id}

    def of_model(self, owner: str) -> Callable[[str, str], LossGraph]:
        """``find(model_id, loss_id)``: the loss, if ``owner``'s session that holds ``model_id`` created it."""

        def find(model_id: str, loss_id: str) -> LossGraph:
            row = self.store.loss(loss_id)
            if row is None or row[0] != owner or session_of(loss_id) != session_of(model_id):
                raise UserError(f"no custom loss {loss_id!r} in this training client's session (unknown, another "
                                "session's or user's, or its session ended); create it with this ServiceClient's "
                                "create_custom_loss", 404)
            if loss_id not in self.graphs:  # (stored before a restart: checked again under today's limits)
                self.graphs[loss_id] = parse_graph(GraphUpload.of(json.loads(row[1])), self.limits)
            return self.graphs[loss_id]

        return find
