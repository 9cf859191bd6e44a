"""The live training clients of the Tinker service and their requests.

:class:`Training` is owned by :class:`~otray.tinker.service.tinker_service.TinkerService` (all its state lives
in that actor). It knows which models are live (a LoRA adapter on their base model's
:class:`~otray.tinker.learner.shared_learner.SharedLearner`), runs each model's mutating requests in
``seq_id`` order (:class:`~otray.tinker.service.futures.OrderedExecutor`), and keeps each live model's
ResourceManager lease (:mod:`otray.tinker.service.leases`) open while it lives.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Awaitable, Callable, Optional

from otray.records import JobState
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from otray.tinker.service import external as X
from otray.tinker.service import runs as R
from otray.tinker.service.catalog import Catalog
from otray.tinker.service.futures import Futures, OrderedExecutor, Outcome
from otray.tinker.service.handover import Handover
from otray.tinker.service.healing import Healing, Pass, Step
from otray.tinker.service.leases import LeaseEnded, Leases, LeaseSpec
from otray.tinker.service.learner_calls import LearnerCalls
from otray.tinker.service.store import Checkpoint, Sampler, Store
from otray.tinker.service.stability import Recordings, with_recordings
from otray.tinker.service.storage import StorageLedger
from otray.tinker.service.train_runs import PassRun, StepRun
from otray.tinker.wire.messages import TrainCall, parse_train_call
from otray.tinker.errors import UserError
from otray.tinker.wire import requests as Q



EPHEMERAL_KEEP = 8  # a training client's latest ephemeral sampler weights kept; older ones are deleted
INFLIGHT = "inflight"  # the directory of a training client's inflight sampler target (every inflight save's)


def inflight_save(req: Q.SaveWeights, kind: str) -> bool:
    """Whether ``req`` publishes its model's inflight target (``kind="inflight"``: every inflight sampling
    client of the model samples the latest such save or a newer one). Other kinds are refused by name."""
    if req.kind not in ("snapshot", INFLIGHT):
        raise UserError(f"save_weights_for_sampler: kind must be 'snapshot' or 'inflight', got {req.kind!r}")
    if req.kind == INFLIGHT and (kind != "sampler" or req.path or req.ttl_seconds):
        raise UserError("kind='inflight' publishes the model's one shared sampler target "
                        "(save_weights_and_get_sampling_client(kind='inflight')): it takes no name or ttl_seconds; "
                        "save a named snapshot for fixed weights")
    return req.kind == INFLIGHT


def adam_step(raw: dict[str, Any]) -> AdamStep:
    """An optim_step's ``adam_params`` checked: AdamW only, numbers in range."""
    if "type" in raw and raw["type"] != "adamw":
        raise UserError(f"optimizer step of type {raw['type']!r}: this service's models use adamw (send AdamParams); "
                        "Dimuon is not offered, its update is not documented")
    try:
        step = AdamStep(**{k: float(v) for k, v in raw.items() if k != "type"})
    except (TypeError, ValueError) as e:
        raise UserError(f"adam_params: {e}") from None
    if step.learning_rate < 0 or not 0 <= step.beta1 < 1 or not 0 <= step.beta2 < 1:
        raise UserError(f"adam_params out of range: {raw}")
    return step

class Training:
    """``learners``: each base model's :class:`~otray.tinker.learner.shared_learner.SharedLearner`, every call
    naming the user it is for (their turns are taken fairly there)."""

    def __init__(self, learners: dict[str, Any], store: Store, catalog: Catalog, futures: Futures,
                 leases: Leases, gap_timeout_s: float, limits: Callable[[str, str], Any], quotas: Callable[[str], Any],
                 recordings: Recordings, replay_bytes: int, coalesce_tokens: int, follow_s: float, calls_ahead: int):
        self.healing = Healing(  # what rebuilds each live model when its learner dies (healing_replay_mb)
            learners, store.root, replay_bytes, leases.recovered, lambda m, why: self.unload(m, why, JobState.FAILED),
            lambda base: [m for m, b in self.live.items() if b == base])
        self.learners, self.store, self.catalog, self.futures, self.leases = learners, store, catalog, futures, leases
        self.storage = StorageLedger(store, quotas)  # storage quotas, with what saves and merges in flight reserved
        self.recordings = recordings  # sampled sequences' stability info, for stable_reinforce
        self.quotas = quotas  # user -> their TinkerQuota
        self.order = OrderedExecutor(futures, gap_timeout_s, calls_ahead)  # a model's requests in order
        self.limits = limits  # (owner, model id) -> the model's ModelLimits (vocabulary, image inputs)
        self.live: dict[str, str] = {}  # model id -> base model, for adapters on a learner now
        self.ended: dict[str, str] = {}  # model id -> why it is no longer live (for the error message)
        self.inflight: dict[str, int] = {}  # model id -> the version of its inflight target last published
        self.holding: dict[str, tuple[str, int]] = {}  # model id -> (owner, LoRA rank): live or being made (quotas)
        # each base model's training calls, small ones of many clients sent as one (scheduling.coalesce_tokens)
        self.calls = {base: LearnerCalls(coalesce_tokens, follow_s=follow_s) for base in learners}
        # training calls handed to the learner in order, several on their way, sent again in order after a death
        self.handover = Handover(self.healing, self.calls, self.learner_of, self.live.get)

    # ------------------------------------------------------------------ live models

    def check_quota(self, owner: str, rank: int) -> None:
        """Refuse a new live model that would take ``owner`` over their quota (a :class:`TinkerQuota`):
        counted over the models live or being made, so concurrent creates cannot slip past it."""
        quota = self.quotas(owner)
        mine = [r for m, (who, r) in self.holding.items() if who == owner]
        if len(mine) + 1 > quota.training_clients:
            raise UserError(f"quota: {owner} holds {len(mine)} live training clients, the limit is "
                            f"{quota.training_clients} (quota.training_clients); close one (its ServiceClient's "
                            "session) or ask an admin for more", 403)
        if sum(mine) + rank > quota.lora_rank:
            raise UserError(f"quota: {owner}'s live training clients hold LoRA rank {sum(mine)} in all; rank {rank} "
                            f"more is over the limit of {quota.lora_rank} (quota.lora_rank); close one, use a "
                            "smaller rank, or ask an admin for more", 403)

    async def open(self, owner: str, model_id: str, base: str, req: Q.CreateModel | Q.LoadWeights, api_key: Optional[str],
                   make: Callable[[], Awaitable[AdapterSpec]], result: dict[str, Any], rank: int) -> dict[str, Any]:
        """A new live model (create_model, create-via-load): ``make()`` (makes its adapter on the learner,
        returns its spec) runs once per model id, then its lease opens; a resubmission gets the same
        request ``<model>:req:0``. Within the owner's ``quota`` (checked first, counting ``rank``)."""
        request_id = f"{model_id}:req:0"
        if model_id not in self.holding:
            self.check_quota(owner, rank)
            self.futures.room(owner, self.quotas(owner).concurrent_requests)
        if self.futures.new(request_id, owner, result["type"]):
            self.holding[model_id] = (owner, rank)
            try:
                spec = await make()
                await self.leases.open(LeaseSpec(model_id, base, spec.rank, req.session_id), api_key)
            except Exception as e:  # noqa: BLE001
                self.holding.pop(model_id, None)
                self.healing.forget(model_id)
                self.learners[base].drop.remote(owner, model_id)
                self.futures.finish(request_id, Outcome.error(R.cause(e), "server"))
            else:
                self.store.add_run(model_id, owner, base, asdict(spec), req.user_metadata)
                self.live[model_id] = base
                self.order.start(model_id)
                self.futures.finish(request_id, Outcome("json", result))
        return {"request_id": request_id, "model_id": model_id}

    async def unload(self, model_id: str, why: str, state: JobState = JobState.SUCCEEDED) -> None:
        """The model leaves its learner (its checkpoints stay) and its lease ends (FAILED: with ``why``)."""
        base = self.live.pop(model_id, None)
        owner = self.holding.pop(model_id, ("", 0))[0]
        self.order.forget(model_id, f"unloaded before this request ran ({why})")
        self.healing.forget(model_id)
        if base is not None:
            self.ended[model_id] = why
            self.calls[base].forget(owner, model_id)
            self.learners[base].drop.remote(owner, model_id, why)
            await self.leases.close(model_id, state, why if state == JobState.FAILED else None)

    def learner_of(self, model_id: str) -> Any:
        if model_id not in self.live:
            why = self.ended.get(model_id, "the service restarted, or its session ended")
            raise UserError(f"model {model_id!r} is not loaded ({why}): load its last checkpoint with "
                            "create_training_client_from_state (your ServiceClient goes on after a restart; after "
                            "its session ended or expired, make a new one)", 404)
        return self.learners[self.live[model_id]]

    def _lease_check(self, model_id: str) -> asyncio.Future:
        """:meth:`_lease_holds`, started as the request arrives and awaited in its turn on the learner: a
        cancel refuses every request sent after it, and a pipelined request (the SDK sends optim_step with
        its forward_backward) takes its place in the learner's queue the moment its predecessor ends;
        waiting for the manager's answer then would give that turn to another user's call, and the
        learner would idle while the answer comes."""
        check = asyncio.ensure_future(self._lease_holds(model_id))
        check.add_done_callback(lambda t: t.cancelled() or t.exception())  # read even if the request ended first
        return check

    async def _send(self, model_id: str, send: Callable[[Any], Awaitable[Any]],
                    check: Optional[asyncio.Future] = None) -> Any:
        """``send(learner)``: one call of ``model_id``'s learner, once ``check`` (its lease check) passed.
        A learner that died (or restarted) under the call: its models are rebuilt, and the call is sent once
        more (:meth:`Healing.call`)."""
        if check is not None:
            await check
        return await self.healing.call(self.live.get(model_id, ""), lambda: send(self.learner_of(model_id)),
                                       lambda: model_id in self.live)  # learner_of raises if the model left

    def logged(self, call: Pass | Step) -> tuple[Pass | Step, int]:
        """``call`` as a model's replay log would record it, with its size (none while healing is off)."""
        return call, self.healing.size(call) if self.healing.on else 0

    async def _ran(self, owner: str, model_id: str, logged: tuple[Pass | Step, int]) -> None:
        """A training call done: in the model's replay log; past the log's bound, a restore point saved."""
        if self.healing.ran(model_id, *logged):
            await self.healing.snapshot(model_id, lambda where: self._send(
                model_id, lambda learner: learner.save.remote(owner, model_id, where, True)))

    @contextmanager
    def refused(self, owner: str, model_id: Any, seq_id: Any) -> Iterator[None]:
        """A request of ``owner``'s own live model that fails its checks before it is queued still uses up
        its ``seq_id`` (the order advances past it), so the same client's next request runs at once."""
        try:
            yield
        except UserError as e:
            model_id = e.model_id or model_id
            seq_id = e.seq_id if e.seq_id is not None else seq_id
            run = self.store.run(model_id) if isinstance(model_id, str) else None
            if run is not None and run.owner == owner and isinstance(seq_id, int) and seq_id >= 1:
                self.order.refuse(model_id, seq_id, owner, str(e))
            raise

    async def _lease_holds(self, model_id: str) -> None:
        """Before a training request runs: a cancelled lease unloads the model and refuses the request."""
        try:
            await self.leases.check(model_id)
        except LeaseEnded as e:
            await self.unload(model_id, str(e), JobState.CANCELLED)
            raise UserError(str(e)) from None

    def _queue(self, owner: str, model_id: str, seq_id: Any, run: Callable[[], Awaitable[Outcome]],
               kind: str) -> dict[str, Any]:
        self.catalog.run(owner, model_id)
        self.store.touch(model_id)
        if not isinstance(seq_id, int) or seq_id < 1:
            raise UserError(f"{model_id}: seq_id must be an integer >= 1, got {seq_id!r}")
        if self.order.counts_against_quota(model_id, seq_id):
            self.futures.room(owner, self.quotas(owner).concurrent_requests)
        return {"request_id": self.order.submit(model_id, seq_id, owner, run, kind), "model_id": model_id}

    # ------------------------------------------------------------------ requests

    def forward_backward(self, owner: str, body: bytes, loss_of: Optional[Callable[[str, str], Any]] = None) -> dict[str, Any]:
        """``loss_of(model_id, loss_id)``: the custom loss a ``custom`` request names (CustomLosses.of_model)."""
        with self.refused(owner, None, None):
            call: TrainCall = parse_train_call(body, lambda m: self.limits(owner, m), loss_of)
        if call.loss_fn == "stable_reinforce":
            with self.refused(owner, call.model_id, call.seq_id):
                call.datums = with_recordings(call, self.recordings, owner)
        self.learner_of(call.model_id)

        run = PassRun(self, owner, call, self._lease_check(call.model_id))
        return self._queue(owner, call.model_id, call.seq_id, run, "forward" if call.forward_only else "forward_backward")

    def optim_step(self, owner: str, req: Q.OptimStep) -> dict[str, Any]:
        model_id = req.model_id
        self.catalog.run(owner, model_id)
        self.learner_of(model_id)
        with self.refused(owner, model_id, req.seq_id):
            step = adam_step(req.params)
        run = StepRun(self, owner, model_id, step, self._lease_check(model_id))
        return self._queue(owner, model_id, req.seq_id, run, "optim_step")

    def save_weights(self, owner: str, req: Q.SaveWeights, kind: str) -> dict[str, Any]:
        """``save_weights`` (kind ``training``: adapter + optimizer), ``save_weights_for_sampler``
        (``sampler``: adapter only; without a name an ephemeral one, and the promise names a new
        sampling session) or ``save_weights_external`` (``external``: PEFT's adapter files for download,
        encrypted to the request's age recipients if any: otray/tinker/service/external.py)."""
        model_id = req.model_id
        self.catalog.run(owner, model_id)
        self.learner_of(model_id)
        name = req.path
        sampler = kind != "training"
        with self.refused(owner, model_id, req.seq_id):
            inflight = inflight_save(req, kind)
        ephemeral = kind == "sampler" and not name
        if ephemeral:
            name = INFLIGHT if inflight else f"ephemeral-{req.seq_id}"
        with self.refused(owner, model_id, req.seq_id):
            R.check_name(name)
            sealed_to = X.recipients(req.age_encryption_recipients) if kind == "external" else []
        ttl = req.ttl_seconds
        overwrite = bool(req.overwrite)

        async def run() -> Outcome:
            if self.store.checkpoint(model_id, kind, name) and not overwrite and not ephemeral:
                raise UserError(f"checkpoint {name!r} exists for {model_id}; pick another name or pass overwrite")
            release = self.storage.reserve(owner, where, self.storage.last_size(model_id, kind))
            try:
                return await saved()
            finally:
                release()

        where = self.store.checkpoint_dir(owner, model_id, kind, name)

        async def saved() -> Outcome:
            version = None
            if inflight:
                version = self.inflight[model_id] = self.inflight.get(model_id, 0) + 1
            size = await self._send(model_id, lambda learner: learner.save.remote(owner, model_id, str(where),
                                                                                  not sampler, version))
            if kind == "external":
                size = X.keep_peft_files(where)
                size = X.encrypt_in_place(where, sealed_to) if sealed_to else size
            ckpt = Checkpoint(model_id, kind, name, str(where), time.time(), int(size),
                              time.time() + ttl if ttl else None, req.user_metadata)
            if ephemeral:
                sid = f"{model_id}:sampler:{req.sampling_session_seq_id}"
                self.store.add_sampler(Sampler(sid, owner, self.live[model_id], None, str(where)))
                self.store.prune_ephemeral(owner, model_id, EPHEMERAL_KEEP)  # the inflight target is not one
                return Outcome("json", {"sampling_session_id": sid, "type": "save_weights_for_sampler"})
            self.store.add_checkpoint(ckpt)
            answer = {"training": "save_weights", "sampler": "save_weights_for_sampler", "external": "save_weights_external"}
            return Outcome("json", {"path": ckpt.tinker_path, "type": answer[kind]})

        return self._queue(owner, model_id, req.seq_id, run, f"save_weights_{kind}")

    def inflight_version(self, model_id: str) -> int:
        """The last version of ``model_id``'s inflight target published (0: none yet)."""
        return self.inflight.get(model_id, 0)


    def load_into(self, owner: str, req: Q.LoadWeights, ckpt: Checkpoint, optimizer: bool) -> dict[str, Any]:
        """``load_weights`` into a live model, in its order."""
        model_id = req.model_id
        if not model_id:
            raise UserError("load_weights: give model_id (load into a live model), or session_id and model_seq_id "
                            "(create a model from the checkpoint)")
        self.learner_of(model_id)

        async def run() -> Outcome:
            await self._send(model_id, lambda learner: learner.load.remote(owner, model_id, ckpt.path, optimizer, False))
            self.healing.loaded_into(model_id, ckpt.path, optimizer)
            return Outcome("json", {"path": req.path, "model_id": model_id, "type": "load_weights"})

        return self._queue(owner, model_id, req.seq_id, run, "load_weights")
