"""TinkerService: the Ray actor that owns the Tinker API's state.

It holds the sessions (:mod:`otray.tinker.service.sessions`), the training runs (one LoRA adapter each, on
the :class:`~otray.tinker.learner.shared_learner.SharedLearner` of their base model), the promises
(:mod:`otray.tinker.service.futures`) and the checkpoint index
(:mod:`otray.tinker.service.store`). The HTTP app (:mod:`otray.tinker.gateway.app`) is a thin layer in front of
it: it checks keys, parses each JSON body into its frozen dataclass (:mod:`otray.tinker.wire.requests`;
no method here takes a dict) and passes the caller's user name (``owner``) with every call. The one
protobuf body, ``forward_backward``'s, is decoded here (``wire.messages.parse_train_call``), against the
model's limits and the session's custom losses, which live here. Every lookup here checks that owner,
so a caller sees only their own runs, checkpoints, samplers and requests (an unknown and another
user's id get the same 404).

Sampling requests are batched (:mod:`otray.tinker.service.sampling`): those waiting while the samplers are
busy go out together, to the base model's vLLM engine where it can serve them (multi-LoRA,
:mod:`otray.tinker.service.engines`), else to the learner's HF ``generate``.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path
from typing import Any, Optional

import ray

from otray.actors.control.resource_manager import get_or_create
from otray.placement import threads_env
from otray.tinker.learner.specs import AdapterSpec
from otray.tinker.config import TinkerConfig, load_tinker, quota_of, shares_of
from otray.tinker.service.session_feeds import SessionFeeds, poll_args
from otray.tinker.service.sessions import Sessions
from otray.tinker.learner.shared_learner import SharedLearner
from otray.tinker.service.engines import VllmSamplers
from otray.tinker.service.futures import Futures, Outcome
from otray.records import JobState
from otray.tinker.service.catalog import Catalog, CopyWeights, RestQuery
from otray.tinker.service.custom_losses import CustomLosses
from otray.tinker.service.leases import Leases
from otray.tinker.service.merge import Merges
from otray.tinker.service.sampling import SampleBatcher, SampleWait
from otray.tinker.service.stability import Recordings
from otray.tinker.service.tokens import Exchanges, load_secret
from otray.tinker.service.store import Sampler, Store, session_of
from otray.tinker.service.training import EPHEMERAL_KEEP, Training
from otray.tinker.errors import UserError
from otray.tinker.wire import requests as Q
from otray.tinker.service import runs as R

NAME = "otray-tinker"
NAMESPACE = "otray"


def start_learners(cfg: TinkerConfig, paths: dict[str, str]) -> dict[str, Any]:
    """One :class:`SharedLearner` actor per base model (found again by name after a service restart),
    restarted if its process dies (its adapters are lost then)."""
    learners, fair = {}, cfg.scheduling
    for m in cfg.models:
        threads = m.num_threads or max(1, int(m.learner_cpus))
        remote = ray.remote(SharedLearner).options(
            name=f"{NAME}-learner-{m.name}", namespace=NAMESPACE, get_if_exists=True, max_restarts=-1,
            num_cpus=m.learner_cpus, num_gpus=m.learner_gpus, **threads_env(threads, m.learner_cpus))
        learners[m.name] = remote.remote(paths[m.name], num_threads=threads, max_model_len=m.max_context_length,
                                         dtype=m.dtype, graph_passes=m.graph_passes, policy=fair.policy, slice_tokens=fair.slice_tokens,
                                         pass_tokens=fair.pass_tokens, wait_for_followers=fair.wait_for_followers,
                                         side_tokens=fair.side_tokens, sample_turn_s=fair.sample_turn_ms / 1000,
                                         follow_s=fair.follow_ms / 1000, shares=shares_of(cfg))
    return learners


class TinkerService:
    """The Tinker API's state, as one named, detached Ray actor behind the TinkerGateway: sessions,
    training clients and their ordered requests, futures, leases, the SQLite store of runs, checkpoints
    and samplers, uploaded custom losses, and a SharedLearner (plus vLLM samplers) per base model.
    Every method checks the caller's identity against what it names: another user's objects read as
    unknown ones."""

    def __init__(self, cfg: dict[str, Any]):
        from otray.models import resolve_model_path

        self.cfg: TinkerConfig = load_tinker(cfg)
        self.store = Store(self.cfg.storage)
        self.futures = Futures(self.cfg.result_ttl_s)
        self.catalog = Catalog(self.store, self.cfg.min_checkpoint_ttl_s, load_secret(self.store.root),
                               self.cfg.external_url_ttl_s, self.futures.timeline)
        self.paths = {m.name: resolve_model_path(m.path, self.cfg.cache_dir) for m in self.cfg.models}
        self.models = {m.name: m for m in self.cfg.models}
        self.limits = R.LimitsBook(self.paths, self.models)  # what every request for a base is checked against
        self.learners: dict[str, Any] = start_learners(self.cfg, self.paths)
        me = ray.get_runtime_context()
        self.leases = Leases(self.store, get_or_create(), (me.current_actor, me.get_actor_id()))
        self.secret, self.exchanges = load_secret(self.store.root), Exchanges()  # JWT auth
        self.recordings = Recordings(self.cfg.stability_ttl_s, self.cfg.stability_max_sequences,
                                     self.cfg.stability_max_tokens)
        self.training = Training(self.learners, self.store, self.catalog, self.futures, self.leases,
                                 self.cfg.gap_timeout_s, lambda owner, m: self.limits.of(self.catalog.run(owner, m).base_model),
                                 lambda user: quota_of(self.cfg, user), self.recordings,
                                 int(self.cfg.healing_replay_mb * 2**20), self.cfg.scheduling.coalesce_tokens,
                                 self.cfg.scheduling.follow_ms / 1000, self.cfg.scheduling.calls_ahead)
        self.sessions = Sessions(self.store, self.cfg.session_timeout_s, self._session_closed)
        self.losses = CustomLosses(self.store, self.futures, self.sessions, self.cfg.custom_loss_server_side,
                                   self.cfg.custom_losses, self.training.storage.room)
        self.merges = Merges(self.store, self.catalog, self.futures, self.paths, self.training.storage)
        self.recovered = False  # leases a predecessor left open are closed on the first call
        self.tasks: list[asyncio.Task] = []  # the session sweep and the learners' watches
        self.engines = VllmSamplers(self.models, self.paths, NAME, NAMESPACE)
        self.batcher = SampleBatcher(self.learners, self.engines, self.futures, self.cfg.sample_batch_wait_ms / 1000,
                                     self.recordings.add, self.cfg.sample_call_max_samples)
        self.feeds = SessionFeeds()  # retrieve_futures: each sampling session's finished requests, in order
        self.futures.on_finish = self.feeds.finished

    async def until_gone(self) -> None:
        """Never answers: the ResourceManager holds this call and fails this service's leases when it
        fails (the actor died or restarted)."""
        await asyncio.Event().wait()

    async def sample_calls(self) -> list[int]:  # requests per sample batch, latest last (batching)
        return list(self.batcher.calls)

    async def learner_use(self) -> dict[str, dict[str, Any]]:  # per base: learner seconds and steps by user
        names = sorted(self.learners)
        return dict(zip(names, await asyncio.gather(*[self.learners[n].usage.remote() for n in names])))

    async def training_calls(self) -> dict[str, Any]:  # per base: learner calls and requests; runs sent ahead
        t = self.training
        return {"sent": {base: dict(c.sent) for base, c in t.calls.items()}, "ahead": t.order.sent_ahead}

    async def sample_engines(self) -> dict[str, Any]:  # prompts per engine; why a vLLM engine is not used
        return {**self.batcher.prompts, "down": dict(self.engines.down), "cancelled": dict(self.batcher.cancelled),
                "inflight_versions": {k: dict(v) for k, v in self.batcher.versions.items()}}

    async def stability(self) -> dict[str, int]:  # sequences recorded, held now, named by stable_reinforce
        return {"recorded": self.recordings.recorded, "held": len(self.recordings.items), "trained": self.recordings.trained}

    async def ready(self) -> list[str]:
        await asyncio.gather(*[h.ping.remote() for h in self.learners.values()])
        await self._recover()
        return sorted(self.learners)

    async def _recover(self) -> None:
        """A restarted service's live models died with it: end the leases it left open."""
        if not self.recovered:
            self.recovered = True
            loop = asyncio.get_running_loop()  # the tasks are kept: the loop holds only weak references
            self.tasks = [loop.create_task(self.sessions.sweep()), loop.create_task(self.catalog.sweep_expired(self.cfg.ttl_sweep_s)),
                          *(loop.create_task(self.training.healing.watch(b)) for b in self.learners)]
            await self.leases.close_inherited(JobState.FAILED, "the Tinker service restarted; its live models are "
                                              "gone: load their last checkpoints with create_training_client_from_state")

    # ------------------------------------------------------------------ sessions and capabilities

    async def capabilities(self, owner: str) -> dict[str, Any]:
        return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_context_length,
                                      "trainable": True, "sampleable": True} for m in self.cfg.models]}

    async def create_session(self, owner: str, req: Optional[Q.CreateSession] = None) -> str:
        await self._recover()
        await self.sessions.expire()
        return self.sessions.new(owner, req)

    async def heartbeat(self, owner: str, req: Q.Heartbeat) -> None:
        self.sessions.heartbeat(owner, req.session_id)

    async def finish_session(self, owner: str, session_id: str, req: Optional[Q.FinishSession] = None) -> None:
        """The SDK's ``close()``: the session's adapters leave the learner (their checkpoints stay)."""
        req = req or Q.FinishSession()
        await self.sessions.finish(owner, session_id, req.reason, req.detail)

    async def _session_closed(self, session_id: str) -> None:
        for model_id in [m for m in self.training.live if session_of(m) == session_id]:
            await self.training.unload(model_id, "its session was closed or expired")

    async def jwt_secret(self) -> bytes:  # the key the gateway checks JWTs with (otray/tinker/service/tokens.py)
        return self.secret

    async def mint_token(self, user: str, tag: str | None, key: str) -> str:  # a JWT for user (key checked theirs,
        return self.exchanges.mint(self.secret, user, key, self.cfg.jwt_ttl_s, tag)  # tag its), key kept for leases

    # ------------------------------------------------------------------ runs

    def _base(self, name: Optional[str]) -> str:
        if name not in self.learners:
            raise UserError(f"base model {name!r} is not offered here; choose one of {sorted(self.learners)}", 404)
        return name

    async def create_model(self, owner: str, req: Q.CreateModel, api_key: Optional[str] = None) -> dict[str, Any]:
        """``create_model``: a new LoRA adapter; the promise resolves to ``{model_id}``."""
        self.sessions.check(owner, req.session_id)
        base = self._base(req.base_model)
        lora = req.lora_config or {}
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= self.models[base].max_rank:
            raise UserError(f"lora rank {rank} is out of range: 1 to {self.models[base].max_rank} on {base}")
        opt = (req.optimizer_config or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer {opt!r} is not offered here; this service trains with adamw")
        seed = lora.get("seed")  # drawn here when not given, so a healed adapter starts as it did (healing.py)
        spec = AdapterSpec(rank, int(seed) if seed is not None else random.randrange(2**31), bool(lora.get("train_mlp", True)), bool(lora.get("train_attn", True)),
                           bool(lora.get("train_unembed", True)), self.models[base].lora_alpha)
        if not spec.target_modules():
            raise UserError("lora_config trains nothing: set one of train_mlp, train_attn, train_unembed")
        model_id = f"{req.session_id}:train:{int(req.model_seq_id)}"
        api_key = self.exchanges.key(self.secret, api_key)

        async def make() -> AdapterSpec:
            await self.learners[base].create.remote(owner, model_id, spec)
            self.training.healing.made(model_id, owner, base, spec)
            return spec

        return await self._opened(req.session_id, await self.training.open(
            owner, model_id, base, req, api_key, make, {"model_id": model_id, "type": "create_model"}, rank))

    async def _opened(self, session_id: str, answer: dict[str, Any]) -> dict[str, Any]:
        """A model made for a session that closed meanwhile is unloaded at once (nobody would end it)."""
        if session_id not in self.sessions.open:
            await self.training.unload(answer["model_id"], "its session was closed or expired")
        return answer

    async def get_info(self, owner: str, req: Q.GetInfo) -> dict[str, Any]:
        run = self.catalog.run(owner, req.model_id)
        return R.info(run, self.paths[run.base_model])

    # ------------------------------------------------------------------ training requests (Training's)

    async def forward_backward(self, owner: str, body: bytes) -> dict[str, Any]:
        return self.training.forward_backward(owner, body, self.losses.of_model(owner))

    async def create_custom_loss(self, owner: str, req: Q.CreateCustomLoss) -> dict[str, Any]:  # custom_losses.py
        return self.losses.create(owner, req)

    async def optim_step(self, owner: str, req: Q.OptimStep) -> dict[str, Any]:
        return self.training.optim_step(owner, req)

    async def save_weights(self, owner: str, req: Q.SaveWeights, kind: str) -> dict[str, Any]:
        return self.training.save_weights(owner, req, kind)

    async def external_file(self, token: str) -> bytes:  # a signed URL's file: the token is the grant
        return self.catalog.external_file(token)

    async def load_weights(self, owner: str, req: Q.LoadWeights, api_key: Optional[str] = None) -> dict[str, Any]:
        """``load_weights``: into a live model (in its order), or create-via-load (a new model whose
        id the client computed: ``{session}:train:{n}``)."""
        ckpt = self.catalog.checkpoint(owner, req.path, read=True, use=True)
        source = self.store.run(ckpt.model_id)
        optimizer = bool(req.optimizer)
        if not req.session_id:
            return self.training.load_into(owner, req, ckpt, optimizer)
        self.sessions.check(owner, req.session_id)
        if req.model_seq_id is None:
            raise UserError("load_weights with a session_id creates a model: give its model_seq_id too")
        model_id = f"{req.session_id}:train:{int(req.model_seq_id)}"
        api_key = self.exchanges.key(self.secret, api_key)
        base = self._base(req.base_model or source.base_model)
        learner = self.learners[base]

        async def make() -> AdapterSpec:
            spec = await learner.load.remote(owner, model_id, ckpt.path, optimizer, True)
            self.training.healing.loaded(model_id, owner, base, ckpt.path, optimizer)
            return spec

        return await self._opened(req.session_id, await self.training.open(
            owner, model_id, base, req, api_key, make, {"path": req.path, "model_id": model_id, "type": "load_weights"},
            int(source.spec["rank"])))

    async def copy_weights(self, owner: str, q: CopyWeights) -> dict[str, str]:
        if q.session_id is not None:
            self.sessions.check(owner, q.session_id)
        self.training.storage.room(owner)
        return self.catalog.copy(owner, q)

    async def merge_weights(self, owner: str, req: Q.MergeWeights) -> dict[str, str]:  # merge.py: a promise
        return self.merges.start(owner, req)

    async def rest(self, owner: str, query: RestQuery) -> Any:
        """A read-only REST call (checkpoints, training runs, weights info, a sampler) or a checkpoint's
        deletion: :meth:`~otray.tinker.service.catalog.Catalog.answer`, owner-checked there. A restarted service
        ends its predecessor's leases first, so what a user reads after the restart is already current (the
        manager's watch of the dead actor may end them later than that)."""
        await self._recover()
        return self.catalog.answer(owner, query)

    # ------------------------------------------------------------------ sampling

    async def create_sampling_session(self, owner: str, req: Q.CreateSamplingSession) -> str:
        self.sessions.check(owner, req.session_id)
        sid = f"{req.session_id}:sampler:{int(req.sampling_session_seq_id)}"
        self.sessions.add_sampler(owner, req.session_id, sid, quota_of(self.cfg, owner).samplers)
        if req.model_path:
            ckpt = self.catalog.checkpoint(owner, req.model_path, read=True, use=True)
            sampler = Sampler(sid, owner, self.store.run(ckpt.model_id).base_model, req.model_path, ckpt.path)
        else:
            sampler = Sampler(sid, owner, self._base(req.base_model), None, None)
        self.store.add_sampler(sampler)
        return sid

    async def asample(self, owner: str, req: Q.ASample) -> dict[str, Any]:
        """``asample``: queued for the next batched learner call; the promise carries one sequence id
        per sample."""
        session = None
        if req.sampling_session_id:
            s = self.catalog.sampler(owner, req.sampling_session_id)
            base, adapter, key = s.base_model, s.adapter_dir, f"{s.sampler_id}:{req.seq_id}"
            session = session_of(s.sampler_id)
        elif req.model_path:
            ckpt = self.catalog.checkpoint(owner, req.model_path, read=True, use=True)
            base, adapter, key = self.store.run(ckpt.model_id).base_model, ckpt.path, uuid.uuid4().hex
        else:
            base, adapter, key = self._base(req.base_model), None, uuid.uuid4().hex
        if adapter is not None and not Path(adapter).is_dir():
            raise UserError(f"the sampler weights at {adapter} were deleted: a training client keeps its latest "
                            f"{EPHEMERAL_KEEP} unnamed (ephemeral) sampler weights; name them "
                            "(save_weights_for_sampler(name)) to keep them", 404)
        wait = R.sample_wait(req, key, adapter, self.cfg, SampleWait, self.limits.of(base))
        if req.record_stability_info:
            if session is None:
                raise UserError("record_stability_info needs a sampling client of a session "
                                "(ServiceClient.create_sampling_client or TrainingClient.create_sampling_client)")
            wait.record = (owner, session)
        ids = [f"{wait.request_id}:{i}" for i in range(wait.n)]
        if wait.request_id not in self.futures.items:
            self.futures.room(owner, quota_of(self.cfg, owner).concurrent_requests)
        if self.futures.new(wait.request_id, owner, "sample"):
            self.feeds.watch(wait.request_id, req)
            self.batcher.submit(base, owner, wait)
        return {"request_id": wait.request_id, "sample_sequence_ids": ids}

    # ------------------------------------------------------------------ promises

    async def cancel_future(self, owner: str, req: Q.CancelFuture) -> dict[str, Any]:
        """``cancel_future``: the SDK abandoned a sampling request (a timeout or a cancelled task): it leaves
        its batch if it has not reached a sampler yet, and its promise fails as cancelled either way."""
        rid = req.request_id
        if not isinstance(rid, str) or self.futures.owner(rid) != owner:
            raise UserError(f"no request {rid!r} (unknown, another user's, or its result expired)", 404)
        return {"request_id": rid, "state": self.batcher.cancel(rid)}

    async def retrieve_futures(self, owner: str, req: Q.RetrieveFutures) -> dict[str, Any]:  # session_feeds.py
        sid, clone, prev, timeout = poll_args(req)
        return await self.feeds.poll((self.catalog.sampler(owner, sid).sampler_id, clone), prev, timeout)

    async def retrieve(self, owner: str, request_id: str) -> Optional[Outcome]:
        return await self.futures.wait(request_id, owner, self.cfg.long_poll_s)
