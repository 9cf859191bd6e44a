"""AdapterLearner: one base model, many LoRA adapters, each trained on its own.

The learner behind the Tinker-compatible service (:mod:`otray.tinker`): every training client
is a named PEFT adapter on one shared base model, with its own rank, its own AdamW state and
its own step count. A call names the adapter it is for; the learner makes that adapter the
only active (and only trainable) one, so gradients never mix: the base is frozen, and the other
adapters neither take part in the forward pass nor receive gradients. An adapter trained
here among others therefore equals the one trained alone on the same data
(tests/tinker/test_service.py, the concurrent users test).

Sampling runs on the same model: a sampler checkpoint (``save_weights_for_sampler``) is loaded
as one more adapter, read-only, and kept in a small least-recently-used cache; the base model
samples with every adapter switched off.

Losses are Tinker's: sums over every token of the datum (no mask: a token that should not
count carries weight 0 or advantage 0), with the per-token formulas of
:mod:`otray.algos.losses`. Each datum gets back its ``logprobs`` and ``elementwise_loss``.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import collections
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from otray.actors.sampling.backends.hf import HFBackend
from otray.tinker.learner.adapter_switch import AdapterSwitch
from otray.tinker.learner.loss_graph import LossGraph
from otray.tinker.learner.loss_run import add_sums, surrogate
from otray.tinker.learner.mixed_lora import RowRouting, groups_of, row_order
from otray.tinker.learner.prompt_scores import PromptScores, Scoring, Targets, score
from otray.actors.learner.core import (PAD_SPREAD, adamw_step, by_length, in_order, loss_inputs, micro_batches,
                                       new_adamw, plan_micro_batches, position_log_softmax, token_logprobs,
                                       topk_logprobs, topk_weights)
from otray.algos.losses import per_token_loss
from otray.device import resolve_device, resolve_dtype
from otray.models import load_model, load_tokenizer
from otray.types import Datum, Sample, SamplingParams

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SAMPLER_CACHE = 4  # sampler checkpoints kept loaded as adapters


@dataclass(frozen=True)
class AdapterSpec:
    """A training client's LoRA: Tinker's ``LoraConfig`` plus the scale (alpha) this service uses."""

    rank: int
    seed: Optional[int] = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = 32.0

    def target_modules(self) -> list[str]:
        return [*(ATTN if self.train_attn else ()), *(MLP if self.train_mlp else ()),
                *(("lm_head",) if self.train_unembed else ())]


@dataclass(frozen=True)
class AdamStep:
    """Tinker's ``AdamParams``: ``grad_clip_norm`` 0 means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class PassResult:
    """One forward(_backward) call: per datum, each target token's logprob and loss; the loss sum."""

    logprobs: list[list[float]]
    losses: list[list[float]]
    loss_sum: float
    metric_sums: dict[str, float] = field(default_factory=dict)  # a custom loss's metrics, summed over datums


@dataclass(frozen=True)
class SampleJob:
    """Prompts that share a model (``adapter``: a sampler checkpoint's directory, or None for the
    base), sampling settings and what else to score (``scoring``: prompt logprobs, top-K, ...;
    :mod:`otray.tinker.learner.prompt_scores`)."""

    adapter: Optional[str]
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    scoring: Scoring = Scoring()
    images: Optional[list[tuple[Any, ...]]] = None  # each prompt's images (a vision-language base model)
    targets: Optional[list[Optional[Targets]]] = None  # each prompt's target_prompt_logprobs


@dataclass
class SampleOut:
    samples: list[Sample]
    prompt_logprobs: Optional[list[Optional[float]]] = None
    scores: Optional[PromptScores] = None  # top-K, targets, alternative tokens (when asked)
    version: Optional[int] = None  # the sampler weights' version (an inflight target's), as loaded


def checkpoint_version(path: str) -> Optional[int]:
    """The version :meth:`AdapterLearner.save` wrote into the checkpoint at ``path`` (inflight targets), else None."""
    return json.loads((Path(path) / "otray_adapter.json").read_text()).get("version")


def scores_of(model: Any, job: SampleJob, i: int, samples: list[list[int]], device: str) -> PromptScores:
    """Prompt ``i`` of ``job``'s scores, from the learner's own forward pass (its images, its masked
    vision tokens), as :mod:`otray.tinker.learner.prompt_scores` describes."""
    images = tuple(job.images[i]) if job.images else ()

    def position_logprobs(tokens: list[int]) -> torch.Tensor:
        n = len(tokens) - 1
        return position_log_softmax(model, Datum(tokens[:-1], tokens[1:], [1.0] * n, [0.0] * n, [0.0] * n,
                                                 images=images), device)

    return score(position_logprobs, job.prompts[i], job.scoring, job.targets[i] if job.targets else None,
                 job.params.temperature, job.params.seed, samples)


class PassNotRun(Exception):
    """A shared pass failed before it added any gradient (its cause chained): its requests can be run
    again one by one."""


@dataclass(frozen=True)
class PassRequest:
    """One client's forward(_backward) work for a pass: its adapter, datums and loss (``graph``: a checked
    custom loss). Requests of one :meth:`pack_key` can share a pass (:meth:`AdapterLearner.forward_many`)."""

    adapter: str
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: Optional[dict[str, float]] = None
    backward: bool = True
    graph: Optional[LossGraph] = None

    def tokens(self) -> int:
        return sum(len(d) for d in self.datums)

    def pack_key(self) -> Optional[tuple]:
        """Requests with equal keys can share a pass: the same gradient mode and the same kind of targets
        (one target a position, or K). None: runs alone (images: a vision tower's rows are not the batch's)."""
        if any(d.images for d in self.datums):
            return None
        first = self.datums[0].target_k
        return self.backward, (len(first[0]) if first else None)


def rows_loss(lp: torch.Tensor, valid: torch.Tensor, batch: list[Datum], device: str, loss_fn: str,
              cfg: dict[str, float], graph: Optional[LossGraph] = None) -> tuple[torch.Tensor, Optional[tuple[float, dict]]]:
    """Per-token losses (``(rows, T)``, zero past each row's end) of rows whose logprobs are ``lp``
    (``(rows, T)``, or ``(rows, T, K)`` for top-K datums). Top-K: ``-sum_k w_k * logprob(target_k)``. A custom
    loss (``graph``): its gradient's surrogate per token, and second its sum and metric sums."""
    if graph is not None:
        tok, loss_sum, metrics = surrogate(graph, batch, lp, device)
        return tok * valid, (loss_sum, metrics)
    if batch[0].target_k is not None:
        tok = -(topk_weights(batch, lp.shape[1], device) * lp).sum(-1)
    else:
        x = loss_inputs(batch, lp.shape[1], device, every_token=True)
        tok = per_token_loss(loss_fn, lp, x.sampler_logprobs, x.advantages, x.weights, **x.extras(), **cfg)
    return tok * valid, None


def batch_loss(model: torch.nn.Module, batch: list[Datum], device: str, loss_fn: str, cfg: dict[str, float],
               graph: Optional[LossGraph] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple[float, dict]]]:
    """One micro-batch's logprobs and per-token losses (:func:`rows_loss`; third a custom loss's sums)."""
    lp, valid = (topk_logprobs if batch[0].target_k is not None else token_logprobs)(model, batch, device)
    tok, custom = rows_loss(lp, valid, batch, device, loss_fn, cfg, graph)
    return lp, tok, custom


class AdapterLearner:
    """One base model holding every training client's adapter and optimizer (the Tinker service runs it
    inside a :class:`~otray.tinker.learner.shared_learner.SharedLearner` actor, which takes users' calls in turns).

    On the GPU Ray gave it (``models[i].learner_gpus``), else the CPU; the frozen base in ``dtype``
    (``auto``: bf16 on a GPU, float32 on the CPU), the adapters and their AdamW state in float32
    (PEFT keeps adapter weights in float32), so adapter updates are exact in either case."""

    def __init__(self, model_path: str, *, num_threads: Optional[int] = None, micro_batch_tokens: int = 8192,
                 max_model_len: Optional[int] = None, dtype: str = "auto", device: str = "auto"):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = model_path
        self.device = resolve_device(device)
        self.base = load_model(model_path, resolve_dtype(dtype, self.device))
        if self.device != "cpu":
            self.base.to(self.device)
        self.tokenizer = load_tokenizer(model_path)
        self.model: Any = None  # the PeftModel, made with the first adapter
        self.specs: dict[str, AdapterSpec] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.steps: dict[str, int] = {}
        self.samplers: collections.OrderedDict[str, str] = collections.OrderedDict()  # dir -> adapter name (LRU)
        self.sampler_specs: dict[str, AdapterSpec] = {}  # sampler adapter name -> its spec
        self.sampler_versions: dict[str, Optional[int]] = {}  # sampler adapter name -> its weights' version
        self.spare: list[str] = []  # sampler adapters no dir uses now: refilled for a dir of the same shape
        self.micro_batch_tokens = micro_batch_tokens
        self.max_model_len = max_model_len or self.base.config.get_text_config().max_position_embeddings
        self.switch = AdapterSwitch()  # which adapter the LoRA layers use
        self.routing = RowRouting()  # which rows each LoRA layer gives which adapter, in a shared pass
        self.training = False  # the model is in train mode (not switched to eval by a sample since)
        self.applied = False  # the current shared pass has added gradients (forward_many)

    def ping(self) -> bool:
        return True

    def adapters(self) -> list[str]:
        return sorted(self.specs)

    # ------------------------------------------------------------------ adapters

    def _add(self, name: str, spec: AdapterSpec) -> None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0,
                            target_modules=spec.target_modules(), task_type="CAUSAL_LM")
        # the adapter's initial values depend on its seed only, not on what else this learner holds
        state = torch.random.get_rng_state()
        torch.manual_seed(spec.seed if spec.seed is not None else random.randrange(2**31))
        try:
            if self.model is None:
                self.model = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
        finally:
            torch.random.set_rng_state(state)
            self.switch.changed()

    def create(self, adapter: str, spec: AdapterSpec) -> None:
        """A new adapter (a training client), its optimizer made at its first step."""
        if adapter in self.specs:
            raise ValueError(f"adapter {adapter!r} exists already")
        self._add(adapter, spec)
        self.specs[adapter] = spec
        self.steps[adapter] = 0

    def drop(self, adapter: str) -> None:
        """Forget an adapter and its optimizer (its saved checkpoints stay)."""
        if self.specs.pop(adapter, None) is not None:
            self.optimizers.pop(adapter, None)
            self.steps.pop(adapter, None)
            self.model.delete_adapter(adapter)
            self.switch.changed()

    def _use(self, adapter: Optional[str]) -> None:
        """Make ``adapter`` the only active one: only it takes part in the pass, so only it gets gradients."""
        if adapter is not None and adapter != self.switch.active:
            if adapter not in self.specs and adapter not in self.samplers.values():
                raise KeyError(f"no adapter {adapter!r} on this learner (it restarted, or the model was unloaded)")
            self.switch.use(self.model, adapter)

    def _train_mode(self) -> None:
        if not self.training:  # model.train() walks every module: only after a sample switched to eval
            self.model.train()
            self.training = True

    def _params(self, adapter: str) -> list[torch.nn.Parameter]:
        return self.switch.params(self.model, adapter)

    # ------------------------------------------------------------------ forward / backward

    def forward_backward(self, adapter: str, datums: list[Datum], loss_fn: str, loss_fn_config: Optional[dict[str, float]]
                         = None, backward: bool = True, graph: Optional[LossGraph] = None) -> PassResult:
        """Add the gradient of ``sum(per-token loss)`` over every datum to ``adapter``'s gradients
        (``backward=False``: the same numbers, no gradient). Datums with K targets per position
        (``target_k``) give back K logprobs per position, flattened. ``graph``: a custom loss instead."""
        self._use(adapter)
        self._train_mode()
        batches, order = plan_micro_batches(datums, self.micro_batch_tokens)
        lps, losses, total, metrics = [], [], 0.0, {}
        for batch in batches:
            with torch.set_grad_enabled(backward):
                lp, tok, custom = batch_loss(self.model, batch, self.device, loss_fn, loss_fn_config or {}, graph)
                loss = tok.sum()
                if backward:
                    loss.backward()
            total += custom[0] if custom else loss.item()
            metrics = add_sums(metrics, custom[1] if custom else {})
            lp, tok = lp.detach().cpu(), tok.detach().cpu()  # one host copy per micro-batch
            lps.extend(lp[i, :len(d)].reshape(-1).tolist() for i, d in enumerate(batch))
            losses.extend(tok[i, :len(d)].tolist() for i, d in enumerate(batch))
        return PassResult(in_order(lps, order), in_order(losses, order), total, metrics)

    def forward_many(self, requests: list[PassRequest]) -> list[PassResult | Exception]:
        """Several clients' requests (of one :meth:`PassRequest.pack_key`) in shared passes: every row goes
        through its own adapter (:class:`~otray.tinker.learner.mixed_lora.RowRouting`), each request's loss is
        its own, and one backward per micro-batch adds each adapter's gradient from its own rows only. So
        each request gets what :meth:`forward_backward` alone gives it (float rounding aside). A request
        whose adapter is gone or whose loss fails gets its exception back, alone; the others go on (a
        failing forward pass itself raises, for the caller to run the requests one by one)."""
        out: list[PassResult | Exception] = [PassResult([], [], 0.0) for _ in requests]
        for i, r in enumerate(requests):
            if r.adapter not in self.specs:
                out[i] = KeyError(f"no adapter {r.adapter!r} on this learner (it was unloaded, or the learner restarted)")
        live = [i for i, r in enumerate(requests) if not isinstance(out[i], Exception)]
        if not live:
            return out
        self._train_mode()
        self.routing.install(self.switch.lora_layers(self.model))
        rank = {r.adapter: k for k, r in enumerate(requests)}  # rows grouped by adapter, in request order
        for name in {requests[i].adapter for i in live}:
            for p in self._params(name):
                p.requires_grad_(True)
        rows = [(i, j) for i in live for j in range(len(requests[i].datums))]
        lps = {i: [None] * len(requests[i].datums) for i in live}
        losses = {i: [None] * len(requests[i].datums) for i in live}
        sums: dict[int, tuple[float, dict]] = {i: (0.0, {}) for i in live}
        backward = requests[live[0]].backward
        try:
            self._shared_passes(requests, out, rows, rank, lps, losses, sums, backward)
        except Exception as e:
            if not self.applied:
                raise PassNotRun(str(e)) from e
            raise
        for i in live:
            if not isinstance(out[i], Exception):
                out[i] = PassResult(lps[i], losses[i], *sums[i])
        return out

    def _shared_passes(self, requests: list[PassRequest], out: list, rows: list[tuple[int, int]], rank: dict[str, int],
                       lps: dict, losses: dict, sums: dict, backward: bool) -> None:
        """:meth:`forward_many`'s micro-batches; ``self.applied`` is set once a backward has run."""
        self.applied = False
        for chunk in self._plan_rows([requests[i].datums[j] for i, j in rows]):
            names = [requests[rows[k][0]].adapter for k in chunk]
            key = row_order(collections.Counter(names), {n: self.specs[n].rank for n in names}, rank)
            chunk.sort(key=lambda k: key(requests[rows[k][0]].adapter))
            batch = [requests[rows[k][0]].datums[rows[k][1]] for k in chunk]
            owners = [rows[k][0] for k in chunk]
            with torch.set_grad_enabled(backward), self.routing.routed(groups_of([requests[i].adapter for i in owners])):
                lp, valid = (topk_logprobs if batch[0].target_k is not None else token_logprobs)(self.model, batch,
                                                                                               self.device)
                terms, parts = [], []
                for i in dict.fromkeys(owners):
                    if isinstance(out[i], Exception):
                        continue
                    at = [k for k, o in enumerate(owners) if o == i]
                    r, sel = requests[i], torch.tensor(at, device=lp.device)
                    try:
                        tok, custom = rows_loss(lp[sel], valid[sel], [batch[k] for k in at], self.device, r.loss_fn,
                                                r.loss_fn_config or {}, r.graph)
                    except Exception as e:  # noqa: BLE001 - this request's own loss: it fails alone
                        out[i] = e
                        continue
                    terms.append(tok.sum())
                    parts.append((i, at, tok, custom))
                if backward and terms:
                    failed = {requests[i].adapter for i in dict.fromkeys(owners) if isinstance(out[i], Exception)}
                    bare = [p for name in failed for p in self._params(name) if p.grad is None]
                    self.applied = True
                    torch.stack(terms).sum().backward()
                    for p in bare:  # a failed request's rows passed zeros back: its adapter keeps no gradient
                        p.grad = None
            lp_host = lp.detach().cpu()
            for i, at, tok, custom in parts:
                tok_host = tok.detach().cpu()
                total, metrics = sums[i]
                sums[i] = (total + (custom[0] if custom else float(tok_host.sum())),
                           add_sums(metrics, custom[1] if custom else {}))
                for n, k in enumerate(at):
                    d, j = batch[k], rows[chunk[k]][1]
                    lps[i][j] = lp_host[k, :len(d)].reshape(-1).tolist()
                    losses[i][j] = tok_host[n, :len(d)].tolist()

    def _plan_rows(self, datums: list[Datum]) -> list[list[int]]:
        """Micro-batches of a shared pass, as lists of indices into ``datums``: one when they fit the token
        budget, else cut shortest first as :func:`plan_micro_batches` cuts a call."""
        if max(len(d) for d in datums) * len(datums) <= self.micro_batch_tokens:
            return [list(range(len(datums)))]
        order = by_length(datums)
        chunks, at = [], 0
        for chunk in micro_batches([datums[i] for i in order], self.micro_batch_tokens, PAD_SPREAD):
            chunks.append(order[at:at + len(chunk)])
            at += len(chunk)
        return chunks

    def optim_step(self, adapter: str, p: AdamStep) -> dict[str, float]:
        """One AdamW step of ``adapter`` on its accumulated gradients; zeroes them."""
        self._use(adapter)
        params = self._params(adapter)
        opt = self.optimizers.get(adapter)
        if opt is None:
            opt = self.optimizers[adapter] = new_adamw(params, lr=p.learning_rate)
        grad_norm = adamw_step(opt, params, learning_rate=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps,
                               weight_decay=p.weight_decay, grad_clip=p.grad_clip_norm if p.grad_clip_norm > 0 else None)
        self.steps[adapter] += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": p.learning_rate,
                "step:max": float(self.steps[adapter])}

    def optim_many(self, works: list[tuple[str, AdamStep]]) -> list[dict[str, float] | Exception]:
        """Several adapters' optimizer steps, each as :meth:`optim_step` gives it. Adapters past their first
        step with the same settings and a gradient on every tensor go in one fused AdamW call over all their
        tensors (a small adapter's step costs the call, not its size: 8 rank-32 adapters of the tiny model
        took 13 ms one by one); the others one by one. An adapter that is gone gets its error, alone."""
        outs: list[Any] = [None] * len(works)
        together: dict[AdamStep, list[int]] = {}
        for i, (adapter, step) in enumerate(works):
            opt = self.optimizers.get(adapter)
            ready = (adapter in self.specs and opt is not None and opt.defaults.get("fused")
                     and all(p.grad is not None and opt.state.get(p) for p in self._params(adapter)))
            if ready:
                together.setdefault(step, []).append(i)
                continue
            try:
                outs[i] = self.optim_step(adapter, step)
            except Exception as e:  # noqa: BLE001 - this adapter's own failure
                outs[i] = e
        for step, idx in together.items():
            for i, metrics in zip(idx, self._fused_steps([works[i][0] for i in idx], step)):
                outs[i] = metrics
        return outs

    def _fused_steps(self, adapters: list[str], p: AdamStep) -> list[dict[str, float]]:
        """One AdamW step of each of ``adapters`` (each with optimizer state and gradients) in one fused call;
        each adapter's gradient clipped by its own norm, as :func:`adamw_step` clips it."""
        from torch.optim.adamw import adamw

        groups = [self._params(a) for a in adapters]
        grads = [[q.grad for q in g] for g in groups]
        norms = [float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g)))) for g in grads]
        if p.grad_clip_norm > 0:
            for g, norm in zip(grads, norms):
                coef = p.grad_clip_norm / (norm + 1e-6)
                if coef < 1.0:
                    torch._foreach_mul_(g, coef)
        flat = [q for g in groups for q in g]
        states = [self.optimizers[a].state[q] for a, g in zip(adapters, groups) for q in g]
        adamw(flat, [q.grad for q in flat], [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], [],
              [st["step"] for st in states], fused=True, amsgrad=False, beta1=p.beta1, beta2=p.beta2,
              lr=p.learning_rate, weight_decay=p.weight_decay, eps=p.eps, maximize=False)
        out = []
        for a, g, norm in zip(adapters, groups, norms):
            for q in g:
                q.grad = None
            self.steps[a] += 1
            out.append({"grad_norm:mean": norm, "learning_rate:mean": p.learning_rate, "step:max": float(self.steps[a])})
        return out

    # ------------------------------------------------------------------ checkpoints

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model, adapter_name=adapter,
                                                                              save_embedding_layers=False).items()}

    def save(self, adapter: str, path: str, optimizer: bool, version: Optional[int] = None) -> int:
        """``adapter`` as a PEFT directory at ``path`` (loadable by transformers, vLLM and ``otray serve``),
        with its optimizer state when ``optimizer`` and ``version`` in its metadata (an inflight target's,
        which samples report); returns the bytes written."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if str(out) in self.samplers:  # overwritten: what is loaded from it is stale
            self.spare.append(self.samplers.pop(str(out)))
        self.model.save_pretrained(str(out), selected_adapters=[adapter], safe_serialization=True,
                                   save_embedding_layers=False)  # the base's (tied) embeddings are not trained
        nested = out / adapter  # PEFT puts a non-default adapter in a subdirectory
        if nested.is_dir():
            for f in nested.iterdir():
                f.replace(out / f.name)
            nested.rmdir()
        meta = {"spec": asdict(self.specs[adapter]), "step": self.steps[adapter], "base": self.model_path,
                **({"version": version} if version is not None else {})}
        (out / "otray_adapter.json").write_text(json.dumps(meta))
        if optimizer and adapter in self.optimizers:
            torch.save(self.optimizers[adapter].state_dict(), out / "optimizer.pt")
        return sum(f.stat().st_size for f in out.iterdir() if f.is_file())

    def load(self, adapter: str, path: str, optimizer: bool, create: bool) -> AdapterSpec:
        """Weights (and with ``optimizer`` the AdamW state and step) saved by :meth:`save` into
        ``adapter``, made first when ``create`` (its spec is the checkpoint's)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        src = Path(path)
        meta = json.loads((src / "otray_adapter.json").read_text())
        spec = AdapterSpec(**meta["spec"])
        if create:
            self.create(adapter, spec)
        elif spec.rank != self.specs[adapter].rank or spec.target_modules() != self.specs[adapter].target_modules():
            raise ValueError(f"checkpoint {path} is a rank-{spec.rank} adapter on {spec.target_modules()}; this "
                             f"model is rank {self.specs[adapter].rank} on {self.specs[adapter].target_modules()}")
        set_peft_model_state_dict(self.model, load_file(str(src / "adapter_model.safetensors")), adapter_name=adapter)
        self.optimizers.pop(adapter, None)
        if optimizer and (src / "optimizer.pt").exists():
            opt = self.optimizers[adapter] = new_adamw(self._params(adapter), lr=1e-4)
            opt.load_state_dict(torch.load(src / "optimizer.pt", weights_only=True, map_location=self.device))
            self.steps[adapter] = int(meta["step"])
        return spec

    # ------------------------------------------------------------------ sampling

    def _sampler_adapter(self, path: str) -> str:
        """The adapter name of sampler checkpoint ``path``, loading it on first use."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if path in self.samplers:
            self.samplers.move_to_end(path)
            return self.samplers[path]
        meta = json.loads((Path(path) / "otray_adapter.json").read_text())
        name = self._sampler_slot(AdapterSpec(**meta["spec"]))
        set_peft_model_state_dict(self.model, load_file(str(Path(path) / "adapter_model.safetensors")), adapter_name=name)
        self.samplers[path] = name
        self.sampler_versions[name] = meta.get("version")
        return name

    def _sampler_slot(self, spec: AdapterSpec) -> str:
        """An adapter to load a ``spec``-shaped sampler checkpoint into: a spare one of the same shape
        (making an adapter costs ~6x loading weights into one), else a new one. At most
        SAMPLER_CACHE sampler adapters exist; the least recently used dir gives its adapter up."""
        from peft import LoraConfig

        if len(self.samplers) >= SAMPLER_CACHE:
            self.spare.append(self.samplers.popitem(last=False)[1])
        shape = (spec.rank, spec.alpha, sorted(spec.target_modules()))
        for name in self.spare:
            s = self.sampler_specs[name]
            if (s.rank, s.alpha, sorted(s.target_modules())) == shape:
                self.spare.remove(name)
                return name
        while self.spare and len(self.spare) + len(self.samplers) >= SAMPLER_CACHE:
            old = self.spare.pop(0)
            self.model.delete_adapter(old)
            self.switch.changed()
            del self.sampler_specs[old]
        name = f"sampler-{len(self.sampler_specs)}-{random.randrange(10**9)}"
        if self.model is None:
            self._add(name, spec)
        else:
            self.model.add_adapter(name, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0,
                                                    target_modules=spec.target_modules(), task_type="CAUSAL_LM"))
            self.switch.changed()
        self.sampler_specs[name] = spec
        return name

    def sample(self, jobs: list[SampleJob]) -> list[list[SampleOut]]:
        """Each job's prompts, ``n`` samples each (one generate call per job); per prompt a
        :class:`SampleOut`."""
        return [self._sample_one(job) for job in jobs]

    def _sample_one(self, job: SampleJob) -> list[SampleOut]:
        from contextlib import nullcontext

        version = None
        if job.adapter is not None:  # loaded outside inference mode: its tensors must stay usable by autograd
            name = self._sampler_adapter(job.adapter)
            self._use(name)
            version = self.sampler_versions.get(name)
        # with no adapter left (the last client dropped its own) the PEFT wrapper still names the deleted one
        # active and fails with a KeyError: the base model itself then (its LoRA layers hold nothing)
        held = self.model is not None and bool(self.model.peft_config)
        model = self.model if held else self.base
        off = self.model.disable_adapter() if (job.adapter is None and held) else nullcontext()
        model.eval()
        self.training = False
        with off, torch.inference_mode():
            backend = HFBackend.on_model(model, self.tokenizer, max_model_len=self.max_model_len, packed_linears=False)
            pictures = {"images": job.images} if job.images else {}
            samples = (backend.generate(job.prompts, job.params, job.n, **pictures) if job.params.max_tokens > 0
                       else [[]] * len(job.prompts))
            outs = [SampleOut(s, version=version) for s in samples]
            if job.scoring != Scoring() or job.targets:
                for i, (p, out) in enumerate(zip(job.prompts, outs)):
                    out.scores = scores_of(model, job, i, [s.token_ids for s in out.samples], self.device)
                    out.prompt_logprobs = out.scores.logprobs
        return outs
