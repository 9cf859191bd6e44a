"""TinkerService: the Ray actor that owns the Tinker API's state.

It holds the sessions, the training runs (one LoRA adapter each, on the :class:`AdapterLearner`
of their base model), the promises (:mod:`otray.tinker.futures`) and the checkpoint index
(:mod:`otray.tinker.store`). The HTTP app (:mod:`otray.tinker.app`) is a thin layer in front of
it: it checks keys, decodes bodies and passes the caller's user name (``owner``) with every
call; every lookup here checks that owner, so a caller sees only their own runs, checkpoints,
samplers and requests (an unknown and another user's id get the same 404).

Sampling requests are batched (:mod:`otray.tinker.sampling`): those waiting while the samplers are
busy go out together, to the base model's vLLM engine where it can serve them (multi-LoRA,
:mod:`otray.tinker.engines`), else to the learner's HF ``generate``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Optional

import ray

from otray.actors.control.resource_manager import get_or_create
from otray.tinker.learner import AdapterLearner, AdapterSpec
from otray.tinker.config import TinkerConfig, load_tinker, quota_of
from otray.tinker.engines import VllmSamplers
from otray.tinker.futures import Futures, Outcome
from otray.records import JobState
from otray.tinker.catalog import Catalog, RestQuery
from otray.tinker.leases import Leases
from otray.tinker.sampling import SampleBatcher, SampleWait
from otray.tinker.store import Sampler, Store
from otray.tinker.training import Training
from otray.tinker.wire import UserError
from otray.tinker import runs as R

NAME = "otray-tinker"
NAMESPACE = "otray"


class TinkerService:
    def __init__(self, cfg: dict[str, Any]):
        from otray.models import resolve_model_path

        self.cfg: TinkerConfig = load_tinker(cfg)
        self.store = Store(self.cfg.storage)
        self.catalog = Catalog(self.store)
        self.futures = Futures(self.cfg.result_ttl_s)
        self.paths = {m.name: resolve_model_path(m.path, self.cfg.cache_dir) for m in self.cfg.models}
        self.models = {m.name: m for m in self.cfg.models}
        self.limits: dict[str, R.ModelLimits] = {}
        self.learners: dict[str, Any] = {}
        for m in self.cfg.models:
            remote = ray.remote(AdapterLearner).options(
                name=f"{NAME}-learner-{m.name}", namespace=NAMESPACE, get_if_exists=True,
                num_cpus=m.learner_cpus, num_gpus=m.learner_gpus,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(m.num_threads or max(1, int(m.learner_cpus)))}})
            self.learners[m.name] = remote.remote(self.paths[m.name], num_threads=m.num_threads or max(1, int(m.learner_cpus)),
                                                  max_model_len=m.max_context_length, dtype=m.dtype)
        self.leases = Leases(self.store, get_or_create())
        self.training = Training(self.learners, self.store, self.catalog, self.futures, self.leases,
                                 self.cfg.gap_timeout_s, self._vocab)
        self.sessions: dict[str, tuple[str, float]] = {}  # session id -> (owner, last heartbeat)
        self.recovered = False  # leases a predecessor left open are closed on the first call
        self.engines = VllmSamplers(self.models, self.paths, NAME, NAMESPACE)
        self.batcher = SampleBatcher(self.learners, self.engines, self.futures, self.cfg.sample_batch_wait_ms / 1000)

    async def sample_calls(self) -> list[int]:
        """Requests per sample batch, latest last (how well requests were batched)."""
        return list(self.batcher.calls)

    async def sample_engines(self) -> dict[str, Any]:
        """Prompts sampled by each engine (``learner``, ``vllm``), and why a vLLM engine is not used."""
        return {**self.batcher.prompts, "down": dict(self.engines.down)}

    async def ready(self) -> list[str]:
        await asyncio.gather(*[h.ping.remote() for h in self.learners.values()])
        await self._recover()
        return sorted(self.learners)

    async def _recover(self) -> None:
        """A restarted service's live models died with it: end the leases it left open."""
        if not self.recovered:
            self.recovered = True
            asyncio.get_running_loop().create_task(self._sweep())
            await self.leases.close_all(JobState.FAILED, "the Tinker service restarted; its live models are gone: "
                                                  "load their last checkpoints with create_training_client_from_state")

    # ------------------------------------------------------------------ sessions and capabilities

    async def capabilities(self, owner: str) -> dict[str, Any]:
        return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_context_length,
                                      "trainable": True, "sampleable": True} for m in self.cfg.models]}

    async def create_session(self, owner: str) -> str:
        await self._recover()
        await self._expire_sessions()
        sid = f"s-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = (owner, time.monotonic())
        return sid

    async def heartbeat(self, owner: str, session_id: str) -> None:
        self._session(owner, session_id)
        self.sessions[session_id] = (owner, time.monotonic())

    async def finish_session(self, owner: str, session_id: str) -> None:
        """The SDK's ``close()``: the session's adapters leave the learner (their checkpoints stay)."""
        self._session(owner, session_id)
        self.sessions[session_id] = (owner, float("-inf"))
        await self._expire_sessions()

    async def _sweep(self) -> None:
        """Expire silent sessions (and end their models' leases) even when no new session comes."""
        while True:
            await asyncio.sleep(max(1.0, self.cfg.session_timeout_s / 4))
            await self._expire_sessions()

    async def _expire_sessions(self) -> None:
        """Sessions whose client stopped sending heartbeats are closed like ``finish_session``."""
        cutoff = time.monotonic() - self.cfg.session_timeout_s
        for sid in [s for s, (_, seen) in self.sessions.items() if seen < cutoff]:
            del self.sessions[sid]
            for model_id in [m for m in self.training.live if m.startswith(f"{sid}:")]:
                await self.training.unload(model_id, "its session was closed or expired")

    def _session(self, owner: str, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is None or s[0] != owner:
            raise UserError(f"no session {session_id!r} (it was closed, expired after "
                            f"{self.cfg.session_timeout_s:.0f} s without heartbeats, or is another user's)", 404)

    # ------------------------------------------------------------------ runs

    def _limits(self, base: str) -> R.ModelLimits:
        """The vocabulary and context length of a base model: what every request for it is checked
        against before it can reach a learner or a batch shared with other users."""
        if base not in self.limits:
            from transformers import AutoConfig

            text = AutoConfig.from_pretrained(self.paths[base]).get_text_config()
            self.limits[base] = R.ModelLimits(int(text.vocab_size), int(self.models[base].max_context_length
                                                                        or text.max_position_embeddings))
        return self.limits[base]

    def _vocab(self, owner: str, model_id: str) -> int:
        return self._limits(self.catalog.run(owner, model_id).base_model).vocab

    def _base(self, name: Optional[str]) -> str:
        if name not in self.learners:
            raise UserError(f"base model {name!r} is not offered here; choose one of {sorted(self.learners)}", 404)
        return name

    async def create_model(self, owner: str, req: dict[str, Any], api_key: Optional[str] = None) -> dict[str, Any]:
        """``create_model``: a new LoRA adapter; the promise resolves to ``{model_id}``."""
        self._session(owner, req["session_id"])
        base = self._base(req.get("base_model"))
        lora = req.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= self.models[base].max_rank:
            raise UserError(f"lora rank {rank} is out of range: 1 to {self.models[base].max_rank} on {base}")
        opt = (req.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer {opt!r} is not offered here; this service trains with adamw")
        spec = AdapterSpec(rank, lora.get("seed"), bool(lora.get("train_mlp", True)), bool(lora.get("train_attn", True)),
                           bool(lora.get("train_unembed", True)), self.models[base].lora_alpha)
        if not spec.target_modules():
            raise UserError("lora_config trains nothing: set one of train_mlp, train_attn, train_unembed")
        model_id = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
        async def make() -> AdapterSpec:
            await self.learners[base].create.remote(model_id, spec)
            return spec

        return await self.training.open(owner, model_id, base, req, api_key, make,
                                        {"model_id": model_id, "type": "create_model"}, rank, quota_of(self.cfg, owner))

    async def get_info(self, owner: str, model_id: str) -> dict[str, Any]:
        run = self.catalog.run(owner, model_id)
        return R.info(run, self.paths[run.base_model])

    # ------------------------------------------------------------------ training requests (Training's)

    async def forward_backward(self, owner: str, body: bytes) -> dict[str, Any]:
        return self.training.forward_backward(owner, body)

    async def optim_step(self, owner: str, req: dict[str, Any]) -> dict[str, Any]:
        return self.training.optim_step(owner, req)

    async def save_weights(self, owner: str, req: dict[str, Any], sampler: bool) -> dict[str, Any]:
        return self.training.save_weights(owner, req, sampler)

    async def load_weights(self, owner: str, req: dict[str, Any], api_key: Optional[str] = None) -> dict[str, Any]:
        """``load_weights``: into a live model (in its order), or create-via-load (a new model whose
        id the client computed: ``{session}:train:{n}``)."""
        ckpt = self.catalog.checkpoint(owner, req["path"])
        source = self.store.run(ckpt.model_id)
        optimizer = bool(req.get("optimizer", False))
        if not req.get("session_id"):
            return self.training.load_into(owner, req, ckpt, optimizer)
        self._session(owner, req["session_id"])
        model_id = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
        base = self._base(req.get("base_model") or source.base_model)
        learner = self.learners[base]

        async def make() -> AdapterSpec:
            return await learner.load.remote(model_id, ckpt.path, optimizer, True)

        return await self.training.open(owner, model_id, base, req, api_key, make,
                                        {"path": req["path"], "model_id": model_id, "type": "load_weights"},
                                        int(source.spec["rank"]), quota_of(self.cfg, owner))

    async def rest(self, owner: str, query: RestQuery) -> Any:
        """A read-only REST call (checkpoints, training runs, weights info, a sampler) or a checkpoint's
        deletion: :meth:`~otray.tinker.catalog.Catalog.answer`, owner-checked there."""
        return self.catalog.answer(owner, query)

    # ------------------------------------------------------------------ sampling

    async def create_sampling_session(self, owner: str, req: dict[str, Any]) -> str:
        self._session(owner, req["session_id"])
        sid = f"{req['session_id']}:sampler:{int(req['sampling_session_seq_id'])}"
        if req.get("model_path"):
            ckpt = self.catalog.checkpoint(owner, req["model_path"])
            sampler = Sampler(sid, owner, self.store.run(ckpt.model_id).base_model, req["model_path"], ckpt.path)
        else:
            sampler = Sampler(sid, owner, self._base(req.get("base_model")), None, None)
        self.store.add_sampler(sampler)
        return sid

    async def asample(self, owner: str, req: dict[str, Any]) -> dict[str, Any]:
        """``asample``: queued for the next batched learner call; the promise carries one sequence id
        per sample."""
        if req.get("sampling_session_id"):
            s = self.catalog.sampler(owner, req["sampling_session_id"])
            base, adapter, key = s.base_model, s.adapter_dir, f"{s.sampler_id}:{req.get('seq_id')}"
        elif req.get("model_path"):
            ckpt = self.catalog.checkpoint(owner, req["model_path"])
            base, adapter, key = self.store.run(ckpt.model_id).base_model, ckpt.path, uuid.uuid4().hex
        else:
            base, adapter, key = self._base(req.get("base_model")), None, uuid.uuid4().hex
        wait = R.sample_wait(req, key, adapter, self.cfg, SampleWait, self._limits(base))
        ids = [f"{wait.request_id}:{i}" for i in range(wait.n)]
        if self.futures.new(wait.request_id, owner):
            self.batcher.submit(base, wait)
        return {"request_id": wait.request_id, "sample_sequence_ids": ids}

    # ------------------------------------------------------------------ promises

    async def retrieve(self, owner: str, request_id: str) -> Optional[Outcome]:
        return await self.futures.wait(request_id, owner, self.cfg.long_poll_s)
