"""TinkerService: the Ray actor that owns the Tinker API's state.

It holds the sessions, the training runs (one LoRA adapter each, on the :class:`AdapterLearner`
of their base model), the promises (:mod:`otray.tinker.futures`) and the checkpoint index
(:mod:`otray.tinker.store`). The HTTP app (:mod:`otray.tinker.app`) is a thin layer in front of
it: it checks keys, decodes bodies and passes the caller's user name (``owner``) with every
call; every lookup here checks that owner, so a caller sees only their own runs, checkpoints,
samplers and requests (an unknown and another user's id get the same 404).

Sampling requests are batched: those waiting while the learner is busy go to it in one call,
grouped by sampler and settings (one ``generate`` per group).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict
from typing import Any, Optional

import ray

from otray.actors.adapters import AdamStep, AdapterLearner, AdapterSpec
from otray.tinker.config import TinkerConfig, load_tinker
from otray.tinker.futures import Futures, OrderedExecutor, Outcome
from otray.tinker.catalog import Catalog
from otray.tinker.sampling import SampleBatcher, SampleWait
from otray.tinker.store import Checkpoint, Sampler, Store
from otray.tinker.wire import TrainCall, UserError, parse_train_call, train_output
from otray.tinker import runs as R

NAME = "otray-tinker"
NAMESPACE = "otray"
REST_VIEWS = ("checkpoints", "delete_checkpoint", "training_run", "training_runs", "weights_info", "get_sampler")


class TinkerService:
    def __init__(self, cfg: dict[str, Any]):
        from otray.models import resolve_model_path

        self.cfg: TinkerConfig = load_tinker(cfg)
        self.store = Store(self.cfg.storage)
        self.catalog = Catalog(self.store)
        self.futures = Futures(self.cfg.result_ttl_s)
        self.order = OrderedExecutor(self.futures, self.cfg.gap_timeout_s)
        self.paths = {m.name: resolve_model_path(m.path, self.cfg.cache_dir) for m in self.cfg.models}
        self.models = {m.name: m for m in self.cfg.models}
        self.vocab: dict[str, int] = {}
        self.learners: dict[str, Any] = {}
        for m in self.cfg.models:
            remote = ray.remote(AdapterLearner).options(
                name=f"{NAME}-learner-{m.name}", namespace=NAMESPACE, get_if_exists=True,
                num_cpus=m.learner_cpus, num_gpus=m.learner_gpus,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(m.num_threads or max(1, int(m.learner_cpus)))}})
            self.learners[m.name] = remote.remote(self.paths[m.name], num_threads=m.num_threads or max(1, int(m.learner_cpus)),
                                                  max_model_len=m.max_context_length)
        self.live: dict[str, str] = {}  # model id -> base model, for adapters on a learner now
        self.sessions: dict[str, tuple[str, float]] = {}  # session id -> (owner, last heartbeat)
        self.batcher = SampleBatcher(self.learners, self.futures, self.cfg.sample_batch_wait_ms / 1000)

    async def sample_calls(self) -> list[int]:
        """Prompts per learner sample call, latest last (how well requests were batched)."""
        return list(self.batcher.calls)

    async def ready(self) -> list[str]:
        await asyncio.gather(*[h.ping.remote() for h in self.learners.values()])
        return sorted(self.learners)

    # ------------------------------------------------------------------ sessions and capabilities

    async def capabilities(self, owner: str) -> dict[str, Any]:
        return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_context_length,
                                      "trainable": True, "sampleable": True} for m in self.cfg.models]}

    async def create_session(self, owner: str) -> str:
        self._expire_sessions()
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
        self._expire_sessions()

    def _expire_sessions(self) -> None:
        """Sessions whose client stopped sending heartbeats are closed like ``finish_session``."""
        cutoff = time.monotonic() - self.cfg.session_timeout_s
        for sid in [s for s, (_, seen) in self.sessions.items() if seen < cutoff]:
            del self.sessions[sid]
            for model_id in [m for m in self.live if m.startswith(f"{sid}:")]:
                self._unload(model_id)

    def _session(self, owner: str, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is None or s[0] != owner:
            raise UserError(f"no session {session_id!r} (it was closed, expired after "
                            f"{self.cfg.session_timeout_s:.0f} s without heartbeats, or is another user's)", 404)

    def _unload(self, model_id: str) -> None:
        base = self.live.pop(model_id, None)
        self.order.forget(model_id)
        if base is not None:
            self.learners[base].drop.remote(model_id)

    # ------------------------------------------------------------------ runs

    def _vocab(self, owner: str, model_id: str) -> int:
        base = self.catalog.run(owner, model_id).base_model
        if base not in self.vocab:
            from transformers import AutoConfig

            self.vocab[base] = int(AutoConfig.from_pretrained(self.paths[base]).vocab_size)
        return self.vocab[base]

    def _base(self, name: Optional[str]) -> str:
        if name not in self.learners:
            raise UserError(f"base model {name!r} is not offered here; choose one of {sorted(self.learners)}", 404)
        return name

    async def create_model(self, owner: str, req: dict[str, Any]) -> dict[str, Any]:
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

        return await self._open(owner, model_id, base, req, make, {"model_id": model_id, "type": "create_model"})

    async def _open(self, owner: str, model_id: str, base: str, req: dict[str, Any], make: Any,
                    result: dict[str, Any]) -> dict[str, Any]:
        """A new live model (create_model, create-via-load): ``make()`` (makes its adapter on the learner,
        returns its spec) runs once per model id, a resubmission gets the same request ``<model>:req:0``."""
        request_id = f"{model_id}:req:0"
        if self.futures.new(request_id, owner):
            try:
                spec = await make()
            except Exception as e:  # noqa: BLE001
                self.futures.finish(request_id, Outcome.error(R.cause(e), "server"))
            else:
                self.store.add_run(model_id, owner, base, asdict(spec), req.get("user_metadata"))
                self.live[model_id] = base
                self.order.start(model_id)
                self.futures.finish(request_id, Outcome("json", result))
        return {"request_id": request_id, "model_id": model_id}

    async def get_info(self, owner: str, model_id: str) -> dict[str, Any]:
        run = self.catalog.run(owner, model_id)
        return R.info(run, self.paths[run.base_model])

    # ------------------------------------------------------------------ training requests

    def _learner_of(self, model_id: str) -> Any:
        if model_id not in self.live:
            raise UserError(f"model {model_id!r} is not loaded (its session ended or the service restarted): "
                            "load its last checkpoint with create_training_client_from_state", 404)
        return self.learners[self.live[model_id]]

    async def forward_backward(self, owner: str, body: bytes) -> dict[str, Any]:
        call: TrainCall = parse_train_call(body, lambda m: self._vocab(owner, m))
        learner = self._learner_of(call.model_id)

        async def run() -> Outcome:
            res = await learner.forward_backward.remote(call.model_id, call.datums, call.loss_fn, call.loss_fn_config,
                                                        not call.forward_only)
            return Outcome("proto", train_output(res.logprobs, res.losses, res.loss_sum))

        return self._queue(owner, call.model_id, call.seq_id, run)

    async def optim_step(self, owner: str, req: dict[str, Any]) -> dict[str, Any]:
        model_id = req["model_id"]
        self.catalog.run(owner, model_id)
        learner = self._learner_of(model_id)
        raw = req.get("adam_params") or req.get("optim_params") or {}
        if "type" in raw and raw["type"] != "adamw":
            raise UserError(f"optimizer step of type {raw['type']!r}: this service's models use adamw")
        try:
            step = AdamStep(**{k: float(v) for k, v in raw.items() if k != "type"})
        except TypeError as e:
            raise UserError(f"adam_params: {e}") from None
        if step.learning_rate < 0 or not 0 <= step.beta1 < 1 or not 0 <= step.beta2 < 1:
            raise UserError(f"adam_params out of range: {raw}")

        async def run() -> Outcome:
            return Outcome("json", {"metrics": await learner.optim_step.remote(model_id, step), "type": "optim_step"})

        return self._queue(owner, model_id, req.get("seq_id"), run)

    def _queue(self, owner: str, model_id: str, seq_id: Any, run: Any) -> dict[str, Any]:
        self.catalog.run(owner, model_id)
        self.store.touch(model_id)
        if not isinstance(seq_id, int) or seq_id < 1:
            raise UserError(f"{model_id}: seq_id must be an integer >= 1, got {seq_id!r}")
        return {"request_id": self.order.submit(model_id, seq_id, owner, run), "model_id": model_id}

    # ------------------------------------------------------------------ checkpoints

    async def save_weights(self, owner: str, req: dict[str, Any], sampler: bool) -> dict[str, Any]:
        """``save_weights`` (adapter + optimizer) or ``save_weights_for_sampler`` (adapter only; without
        a name an ephemeral one, and the promise names a new sampling session)."""
        model_id = req["model_id"]
        self.catalog.run(owner, model_id)
        learner = self._learner_of(model_id)
        name = req.get("path")
        ephemeral = sampler and not name
        if ephemeral:
            name = f"ephemeral-{req.get('seq_id')}"
        R.check_name(name)
        kind = "sampler" if sampler else "training"
        ttl = req.get("ttl_seconds")
        overwrite = bool(req.get("overwrite", False))

        async def run() -> Outcome:
            if self.store.checkpoint(model_id, kind, name) and not overwrite and not ephemeral:
                raise UserError(f"checkpoint {name!r} exists for {model_id}; pick another name or pass overwrite")
            where = self.store.checkpoint_dir(owner, model_id, kind, name)
            size = await learner.save.remote(model_id, str(where), not sampler)
            ckpt = Checkpoint(model_id, kind, name, str(where), time.time(), int(size),
                              time.time() + ttl if ttl else None, req.get("user_metadata"))
            if ephemeral:
                sid = f"{model_id}:sampler:{req.get('sampling_session_seq_id')}"
                self.store.add_sampler(Sampler(sid, owner, self.live[model_id], None, str(where)))
                return Outcome("json", {"sampling_session_id": sid, "type": "save_weights_for_sampler"})
            self.store.add_checkpoint(ckpt)
            return Outcome("json", {"path": ckpt.tinker_path, "type": "save_weights_for_sampler" if sampler else "save_weights"})

        return self._queue(owner, model_id, req.get("seq_id"), run)

    async def load_weights(self, owner: str, req: dict[str, Any]) -> dict[str, Any]:
        """``load_weights``: into a live model (in its order), or create-via-load (a new model whose
        id the client computed: ``{session}:train:{n}``)."""
        ckpt = self.catalog.checkpoint(owner, req["path"])
        source = self.store.run(ckpt.model_id)
        optimizer = bool(req.get("optimizer", False))
        if req.get("session_id"):  # create-via-load
            self._session(owner, req["session_id"])
            model_id = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
            base = self._base(req.get("base_model") or source.base_model)
            learner = self.learners[base]
            return await self._open(owner, model_id, base, req,
                                    lambda: learner.load.remote(model_id, ckpt.path, optimizer, True),
                                    {"path": req["path"], "model_id": model_id, "type": "load_weights"})
        model_id = req["model_id"]
        learner = self._learner_of(model_id)

        async def run() -> Outcome:
            await learner.load.remote(model_id, ckpt.path, optimizer, False)
            return Outcome("json", {"path": req["path"], "model_id": model_id, "type": "load_weights"})

        return self._queue(owner, model_id, req.get("seq_id"), run)

    async def rest(self, owner: str, view: str, *args: Any) -> Any:
        """The read-only REST calls (checkpoints, delete_checkpoint, training_run(s), weights_info,
        get_sampler): :class:`~otray.tinker.catalog.Catalog`'s methods, owner-checked there."""
        if view not in REST_VIEWS:
            raise UserError(f"no view {view!r}", 404)
        return getattr(self.catalog, view)(owner, *args)

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
        wait = R.sample_wait(req, key, adapter, self.cfg, SampleWait)
        ids = [f"{wait.request_id}:{i}" for i in range(wait.n)]
        if self.futures.new(wait.request_id, owner):
            self.batcher.submit(base, wait)
        return {"request_id": wait.request_id, "sample_sequence_ids": ids}

    # ------------------------------------------------------------------ promises

    async def retrieve(self, owner: str, request_id: str) -> Optional[Outcome]:
        return await self.futures.wait(request_id, owner, self.cfg.long_poll_s)
