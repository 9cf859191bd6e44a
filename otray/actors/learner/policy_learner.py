"""PolicyLearner: one policy's torch model, optimizer and losses.

A plain class: tests use it in-process, jobs wrap it with ``ray.remote``. The
Tinker-style primitives:

- ``forward(datums)``: per-target-token logprobs, no gradient.
- ``forward_backward(datums, loss_fn, loss_fn_config, aggregation)``: adds the
  gradient of the aggregated loss over *all* datums to the accumulated gradients.
  Datums are cut into micro-batches whose padded size stays under
  ``micro_batch_tokens``; normalizers are computed over the whole call, so the
  result does not depend on the cut.
- ``optim_step(learning_rate, ...)``: one AdamW step with gradient clipping, then
  zeroes the gradients and bumps ``version``.
- ``save_state`` / ``load_state``, ``export`` (PEFT adapter or full HF model),
  ``weights()`` (a :class:`WeightUpdate` for rollout workers).

``rank == 0`` trains every parameter; ``rank > 0`` trains a LoRA adapter only. ``dtype`` is the
precision it computes in; what it stores is :mod:`otray.actors.learner.precision`'s call (full
bf16 training keeps float32 master weights). ``micro_batch_tokens=0`` derives the budget from the
free GPU memory; ``gradient_checkpointing`` recomputes each layer's activations in the backward pass.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from otray.actors.learner.anchor import Anchor, kl_to_anchor
from otray.actors.learner.core import (LossSums, adamw_step, batch_stats, global_normalizer, grad_norm, in_order,
                                       loss_inputs, new_adamw, plan_micro_batches, scale_learning_rate, token_logprobs,
                                       trainable)
from otray.actors.learner.precision import budget_for, learner_precision
from otray.actors.learner.state import load_sharded, load_whole, read_meta, restore_rng, save_whole, write_meta
from otray.actors.sampling.backends.base import Backend
from otray.actors.sampling.device_transport import device_id
from otray.actors.sampling.transport import Publisher
from otray.algos.losses import aggregate, per_token_loss
from otray.device import resolve_device, resolve_dtype
from otray.placement import current_node_id
from otray.records import CheckpointMeta
from otray.timing import BusyClock, busy
from otray.models import LoraSpec, apply_lora, copy_side_files, load_model, load_tokenizer
from otray.vlm import is_vision_param
from otray.types import (Datum, GenerateResult, LearnerInfo, LossNormalizer, SamplingParams,
                         WeightUpdate, WorkerInfo)


class PolicyLearner:
    """One trained policy's model, optimizer and losses, as a Ray actor of its job (bundle 0 of its policy)
    or in-process (tests, ``otray.local``); with ``rollout.colocate`` it also samples (``start_sampler``)."""

    whole_model_on_device = True  # a sharded rank moves only its shards (otray.actors.learner.rank)

    def __init__(self, model_path: str, *, lora: LoraSpec | dict[str, Any] | None = None, dtype: str = "float32",
                 micro_batch_tokens: int = 8192, seed: int = 0, num_threads: int | None = None, device: str = "auto",
                 gradient_checkpointing: bool = False, vision_lr_scale: float = 1.0):
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        random.seed(seed)
        self.model_path = model_path
        self.lora = LoraSpec(**lora) if isinstance(lora, dict) else (lora or LoraSpec())
        self.device = resolve_device(device)  # the GPU Ray gave this actor, else the CPU (otray.device)
        self.precision = learner_precision(dtype, self.device, self.lora.rank > 0)
        model = load_model(model_path, self.precision.storage)
        if self.device != "cpu" and self.whole_model_on_device:
            model.to(self.device)
        self.checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = apply_lora(model, self.lora) if self.lora.rank > 0 else model
        self.vision_lr_scale = vision_lr_scale
        slow_vision(self.model, vision_lr_scale)
        self.budget_setting = micro_batch_tokens  # 0: auto (precision.budget_for), set at the first call
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0  # optimizer steps taken
        self.version = 0  # policy version; bumped by every optim_step
        self.extra_state: dict[str, Any] = {}  # job-level state saved with checkpoints
        self.busy = BusyClock()  # seconds spent in forward passes, optimizer steps and weight export
        self.sampler: Backend | None = None  # colocated generation (``start_sampler``)
        self.publisher = Publisher(self.device)  # weights out, over rollout.weight_sync (sampling.transport)
        self.anchor: Anchor | None = None  # the policy RL started from (algo.kl_coeff's reference)

    def busy_s(self) -> float:
        return self.busy.total

    @property
    def micro_batch_tokens(self) -> int:
        if self.budget_setting <= 0:
            self.budget_setting = budget_for(self.model, self.device, self.precision, self.checkpointing)
        return self.budget_setting

    def token_budget(self) -> int:
        """The padded tokens one micro-batch may take (``algo.micro_batch_tokens``, resolved)."""
        return self.micro_batch_tokens

    def ping(self) -> bool:
        return True

    def info(self) -> LearnerInfo:
        return LearnerInfo(self.step, self.version, self.lora.rank, current_node_id(), device_id(self.device))

    @property
    def is_lora(self) -> bool:
        return self.lora.rank > 0

    # ------------------------------------------------------------------ forward passes

    @busy
    def forward(self, datums: Sequence[Datum]) -> list[list[float]]:
        """Learner logprob of each target token (one list per datum, unpadded)."""
        batches, order = plan_micro_batches(datums, self.micro_batch_tokens)
        return in_order([row for rows in self.logprobs_of(batches) for row in rows], order)

    @torch.no_grad()
    def logprobs_of(self, batches: Sequence[Sequence[Datum]]) -> list[list[list[float]]]:
        """:meth:`forward` on micro-batches cut already: one list of rows per micro-batch (an empty
        micro-batch is an idle pass and gives an empty list)."""
        self.model.eval()
        out: list[list[list[float]]] = []
        for batch in batches:
            if not batch:
                self.idle_pass(backward=False)
                out.append([])
                continue
            with self.precision.autocast(self.device):
                lp, _ = token_logprobs(self.model, list(batch), self.device)
            lp = lp.cpu()  # one host copy per micro-batch
            out.append([lp[i, : len(d)].tolist() for i, d in enumerate(batch)])
        return out

    @busy
    def forward_backward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None,
                         aggregation: str = "token_mean", normalizer: LossNormalizer | None = None,
                         kl_to_start: float = 0.0) -> dict[str, float]:
        """Accumulate gradients of the aggregated loss; returns loss metrics for this call.

        ``normalizer`` sets what ``token_mean`` and ``seq_mean_token_mean`` divide by, when
        ``datums`` is part of a larger batch whose other members were left out because they
        carry no gradient (zero advantage); by default the datums' own totals. ``kl_to_start`` > 0
        adds that times the per-token KL to the anchor (:meth:`set_anchor`) to every token's loss."""
        if not datums:
            return LossSums().metrics(loss_fn)
        norm = global_normalizer(datums, normalizer)
        out = self.accumulate(plan_micro_batches(datums, self.micro_batch_tokens)[0], loss_fn, loss_fn_config,
                              aggregation, norm, kl_to_start).metrics(loss_fn)
        return {**out, "kl_to_start": out.get("kl_to_start", 0.0)} if kl_to_start else out

    def set_anchor(self, keep: bool = False) -> bool:
        """Take the weights as they are now as the policy RL started from (``keep``: unless one is held
        already, e.g. loaded with a checkpoint). Returns whether one was taken."""
        if keep and self.anchor is not None:
            return False
        self.anchor = Anchor.of(self.model)
        return True

    def accumulate(self, batches: Sequence[Sequence[Datum]], loss_fn: str, loss_fn_config: dict[str, float] | None,
                   aggregation: str, norm: LossNormalizer, kl_to_start: float = 0.0) -> LossSums:
        """Backward over each micro-batch in turn, the aggregation divided by ``norm`` (the whole
        batch's totals); returns the sums the metrics are made of. An empty micro-batch is an idle
        pass (:meth:`idle_pass`)."""
        if kl_to_start and self.anchor is None:
            raise RuntimeError("forward_backward with kl_to_start > 0 needs the starting policy: call set_anchor first")
        t0 = time.perf_counter()
        self.model.train()
        cfg = dict(loss_fn_config or {})
        stats, tokens, sequences = [], 0.0, 0.0
        for batch in batches:
            if not batch:
                self.idle_pass(backward=True)
                continue
            # the anchor's logprobs first: no graph may hold its swapped-in storage (otray.actors.learner.anchor)
            ref = (self.anchor.logprobs(self.model, batch, self.device, self.precision.autocast(self.device))
                   if kl_to_start else None)
            with self.precision.autocast(self.device):
                lp, valid = token_logprobs(self.model, batch, self.device)
            inputs = loss_inputs(batch, lp.shape[1], self.device)
            mask, q = inputs.mask * valid, inputs.sampler_logprobs
            tok_loss = per_token_loss(loss_fn, lp, q, inputs.advantages, inputs.weights, **inputs.extras(), **cfg)
            kl = kl_to_anchor(lp, ref) if ref is not None else None
            if kl is not None:
                tok_loss = tok_loss + kl_to_start * kl
            loss = aggregate(tok_loss, mask, aggregation, total_tokens=norm.tokens, total_sequences=norm.sequences)
            loss.backward()
            stats.append(batch_stats(loss, lp, q, mask, loss_fn, cfg, kl))  # stays on the device
            tokens += float(sum(sum(d.mask) for d in batch))
            sequences += float(len(batch))
        sums = LossSums.of(stats, tokens, sequences)  # one host copy for the whole call
        sums.compute_s = time.perf_counter() - t0  # inside the learner, without transport
        return sums

    def idle_pass(self, backward: bool) -> None:
        """A forward (and backward) pass that changes nothing: a sharded rank with fewer micro-batches
        than another runs these, so that every rank joins every collective. Here, unsharded, nothing."""

    # ------------------------------------------------------------------ optimizer

    @busy
    def optim_step(self, learning_rate: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0, grad_clip: float | None = 1.0,
                   vision_lr_scale: float | None = None) -> dict[str, float]:
        """One AdamW step on the accumulated gradients; zeroes them; bumps the version (:func:`vision_grad_norm`).
        ``vision_lr_scale``: a VLM's vision tower at this times ``learning_rate`` (an RL step's
        ``algo.vision_lr_scale``), not ``model.vision_lr_scale``."""
        params = trainable(self.model)
        if self.optimizer is None:
            self.optimizer = new_adamw(params, lr=learning_rate)
        vision = vision_grad_norm(self.model)  # (read before the step zeroes the gradients)
        norm = adamw_step(self.optimizer, params, learning_rate=learning_rate, betas=betas, eps=eps,
                          weight_decay=weight_decay, grad_clip=grad_clip, vision_lr_scale=vision_lr_scale)
        self.step += 1
        self.version += 1
        out = {"grad_norm": norm, "learning_rate": learning_rate, "step": self.step, **vision}
        if self.device.startswith("cuda"):  # since the last optim_step: forward_backward and this step
            out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        return out

    # ------------------------------------------------------------------ colocated generation

    def start_sampler(self, max_model_len: int | None = None, max_batch: int = 256,
                      sampler: str = "auto", compile_backend: str = "inductor") -> WorkerInfo:
        """Let this learner stand in for a rollout worker (``rollout.colocate``): ``generate`` samples
        from the model being trained, so its weights are always the current policy and no weights
        move. ``sampler``: ``rollout.sampler`` (a compiled one is warmed up here, before step 1).
        Returns what ``RolloutWorker.info`` returns."""
        from otray.actors.sampling.backends.hf import HFBackend

        compute = getattr(torch, self.precision.compute) if self.precision.compute else None
        with self.precision.autocast(self.device):
            self.sampler = HFBackend.on_model(self.model, load_tokenizer(self.model_path),
                                              max_model_len=max_model_len, max_batch=max_batch,
                                              weights_version=lambda: self.version, sampler=sampler, dtype=compute,
                                              compile_backend=compile_backend)
        return WorkerInfo("hf-colocated", self.sampler.max_model_len, tuple(self.sampler.stop_token_ids),
                          self.version, current_node_id(), sampler=self.sampler.sampler,
                          compile_s=self.sampler.compile_s)

    @busy
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 images: list[Any] | None = None) -> list[GenerateResult]:
        if self.sampler is None:
            raise RuntimeError("this learner does not generate: call start_sampler first (rollout.colocate)")
        self.model.eval()
        with self.precision.autocast(self.device):
            samples = self.sampler.generate(prompts, params, n, images)
        if self.device.startswith("cuda"):  # the KV cache's blocks go back before the update needs them
            torch.cuda.empty_cache()
        return [GenerateResult(s, self.version) for s in samples]

    def update_weights(self, update: Any = None) -> int:
        """The rollout-worker call, colocated: the sampler already holds the current weights."""
        return self.version

    def policy_version(self) -> int:
        return self.version

    # ------------------------------------------------------------------ weights out

    @busy
    def weights(self, transport: str = "object_store", dtype: str | None = None) -> WeightUpdate:
        """Current weights for rollout workers: the adapter (LoRA) or every parameter, in ``dtype`` (the
        workers'; None: as stored), over ``transport`` (``sampling.transport``), with their checksum."""
        if self.is_lora:
            from peft import get_peft_model_state_dict

            state, kind, lora = get_peft_model_state_dict(self.model), "lora", self._lora_config_dict()
        else:
            # Every entry, tied lm_head included: vLLM's in-place reload leaves the head
            # stale when only embed_tokens arrives (measured: logprobs off by ~1.6).
            state, kind, lora = self.model.state_dict(), "full", None
        return self.publisher.update(state, self.version, kind, lora, transport, dtype)

    def open_broadcast(self) -> str:
        """An address for a broadcast group (``rollout.weight_sync: broadcast``) of this learner and its workers."""
        return self.publisher.device.open_broadcast()

    def join_broadcast(self, address: str, world: int) -> int:
        """Join that group as rank 0 (the workers join at the same time)."""
        return self.publisher.device.join_broadcast(address, world)

    @busy
    def send_weights(self) -> None:
        """Broadcast the update the last ``weights("broadcast")`` published (the workers receive it now)."""
        self.publisher.device.send()

    def _lora_config_dict(self) -> dict[str, Any]:
        cfg = self.model.peft_config["default"].to_dict()
        return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}

    def export(self, path: str) -> str:
        """Write a PEFT adapter (LoRA) or a full HF model (+ tokenizer) loadable by transformers and vLLM."""
        return self.save_pretrained(path)

    def save_pretrained(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> str:
        """:meth:`export` from ``state_dict`` (whole tensors; default: the model's own) into ``path``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        extra = {} if state_dict is None else {"state_dict": state_dict}
        self.model.save_pretrained(out, safe_serialization=True, **extra)
        copy_side_files(self.model_path, out)
        return str(out)

    # ------------------------------------------------------------------ checkpoints

    def meta(self) -> CheckpointMeta:
        """What ``meta.json`` says of this learner (:mod:`otray.actors.learner.state`)."""
        return CheckpointMeta(self.step, self.version, asdict(self.lora), self.model_path, self.extra_state,
                              optimizer=self.optimizer is not None)

    def save_state(self, path: str, extra_state: dict[str, Any] | None = None) -> str:
        """Weights or adapter, optimizer, step, version, RNG, and ``extra_state`` (job data, e.g. data position)."""
        if extra_state is not None:
            self.extra_state = extra_state
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_whole(self.model, self.optimizer, out)
        if self.anchor is not None:
            self.anchor.save(out)
        write_meta(out, self.meta())
        return str(out)

    def load_state(self, path: str) -> CheckpointMeta:
        """A checkpoint of this learner's kind, or a sharded group's (any number of ranks saved it)."""
        src = Path(path)
        meta = read_meta(src, self.lora.rank)
        if meta.sharded:
            self.optimizer = load_sharded(self.model, self.optimizer, src, meta)
        else:
            self.optimizer = load_whole(self.model, src, self.device)
        self.anchor = Anchor.load(src, self.device)
        self.restore_counters(src, meta)
        return meta

    def restore_counters(self, src: Path, meta: CheckpointMeta) -> None:
        """RNG state, step, version and the job's ``extra_state`` from a checkpoint."""
        restore_rng(src)
        self.step, self.version, self.extra_state = meta.step, meta.version, meta.extra_state


def vision_grad_norm(model: torch.nn.Module) -> dict[str, float]:
    """``{"grad_norm_vision": norm}``: the gradient norm of a VLM's trained vision tower and projector (which
    part of the model a step's gradient, and a spike of it, comes from); ``{}`` for a model without one."""
    vision = [p for n, p in model.named_parameters() if p.requires_grad and is_vision_param(n)]
    return {"grad_norm_vision": grad_norm(vision)} if vision else {}


def slow_vision(model: torch.nn.Module, scale: float) -> None:
    """``model.vision_lr_scale``: a VLM's vision tower trains at ``scale`` times the step's learning rate (0:
    frozen, no gradients). Measured on the tiny VLM (NOTES.md, issue 55): at the language model's rate the
    warm-up grew the red shapes' image features ~200x (norm 0.6 -> 120) and left green and blue 0.8 apart
    with a spread of 2 within each colour."""
    if scale == 1.0:
        return
    vision = [p for n, p in model.named_parameters() if p.requires_grad and is_vision_param(n)]
    for p in vision if scale == 0 else ():
        p.requires_grad_(False)
    scale_learning_rate(vision if scale else [], scale, vision=True)

