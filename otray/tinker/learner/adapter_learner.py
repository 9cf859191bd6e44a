"""AdapterLearner: one base model, many LoRA adapters, each trained on its own.

The learner behind the Tinker-compatible service (:mod:`otray.tinker`): every training client
is a named PEFT adapter on one shared base model, with its own rank, its own AdamW state and
its own step count. A call names the adapter it is for; the learner makes that adapter the
only active (and only trainable) one, so gradients never mix: the base is frozen, and the other
adapters neither take part in the forward pass nor receive gradients. An adapter trained
here among others therefore equals the one trained alone on the same data
(tests/tinker/test_service.py, the concurrent users test).

Sampling runs on the same model (:class:`~otray.tinker.learner.learner_sampling.LearnerSampling`): a
sampler checkpoint (``save_weights_for_sampler``) is loaded as one more adapter, read-only, and kept in a
small least-recently-used cache; the base model samples with every adapter switched off.

Losses are Tinker's: sums over every token of the datum (no mask: a token that should not
count carries weight 0 or advantage 0), with the per-token formulas of
:mod:`otray.algos.losses`. Each datum gets back its ``logprobs`` and ``elementwise_loss``.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from otray.tinker.errors import AdapterGone
from otray.tinker.learner.adapter_switch import AdapterSwitch
from otray.tinker.learner.loss_graph import LossGraph
from otray.tinker.learner.learner_sampling import LearnerSampling, SampleRun
from otray.tinker.learner.loss_run import add_sums
from otray.tinker.learner.adapter_steps import Answer, AdapterSteps
from otray.tinker.learner.lane_gate import LaneGate
from otray.tinker.learner.lora_bank import LoraBank
from otray.tinker.learner.mixed_lora import RowRouting
from otray.tinker.learner.pass_graphs import GRAPH_TOKENS, PassGraphs
from otray.tinker.learner.sample_jobs import SampleJob, SampleOut
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from otray.tinker.learner.passes import PassRequest, PassResult
from otray.tinker.learner.shared_pass import SharedPass, batch_loss
from otray.actors.learner.core import in_order, new_adamw, plan_micro_batches
from otray.device import resolve_device, resolve_dtype
from otray.models import load_model, load_tokenizer
from otray.types import Datum


class AdapterLearner:
    """One base model holding every training client's adapter and optimizer (the Tinker service runs it
    inside a :class:`~otray.tinker.learner.shared_learner.SharedLearner` actor, which takes users' calls in turns).

    On the GPU Ray gave it (``models[i].learner_gpus``), else the CPU; the frozen base in ``dtype``
    (``auto``: bf16 on a GPU, float32 on the CPU), the adapters and their AdamW state in float32
    (PEFT keeps adapter weights in float32), so adapter updates are exact in either case."""

    def __init__(self, model_path: str, *, num_threads: Optional[int] = None, micro_batch_tokens: int = 8192,
                 max_model_len: Optional[int] = None, dtype: str = "auto", device: str = "auto",
                 graph_passes: bool = False):
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
        self.optim = AdapterSteps()  # each adapter's AdamW and step count
        self.sampling = LearnerSampling(self)  # sampler checkpoints loaded as read-only adapters, and sampling
        self.micro_batch_tokens = micro_batch_tokens
        self.max_model_len = max_model_len or self.base.config.get_text_config().max_position_embeddings
        self.switch = AdapterSwitch()  # which adapter the LoRA layers use
        self.gate = LaneGate()  # a side-lane call computes alone (the main lane's pass waits at its LoRA layers)
        self.bank = LoraBank()  # each LoRA layer's training adapters' weights, stacked by rank (a slot each)
        self.routing = RowRouting(self.gate, self.bank)  # which rows each LoRA layer gives which adapter, in a shared pass
        self.training = False  # the model is in train mode (not switched to eval by a sample since)
        self.graph_passes = graph_passes  # shared passes bucketed (CUDA graphs on a GPU): pass_graphs.py
        self.graphs: Optional[PassGraphs] = None  # made with the model

    def adapters(self) -> list[str]:
        return sorted(self.specs)

    # ------------------------------------------------------------------ adapters

    def add_lora(self, name: str, spec: AdapterSpec) -> None:
        """A LoRA adapter ``name`` of ``spec``'s shape on the model (made with the first), its initial values
        from ``spec.seed`` alone."""
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
        self.add_lora(adapter, spec)
        self.bank.place(adapter, self.switch.lora_layers(self.model))
        self.specs[adapter] = spec
        self.optim.add(adapter)

    def drop(self, adapter: str) -> None:
        """Forget an adapter and its optimizer (its saved checkpoints stay)."""
        if self.specs.pop(adapter, None) is not None:
            self.optim.forget(adapter)
            self.remove_lora(adapter)
            self.bank.release(adapter)

    def remove_lora(self, name: str) -> None:
        """Delete adapter ``name`` from the model."""
        self.model.delete_adapter(name)
        self.switch.changed()

    def use(self, adapter: Optional[str]) -> None:
        """Make ``adapter`` the only active one: only it takes part in the pass, so only it gets gradients."""
        if adapter is not None and adapter != self.switch.active:
            if adapter not in self.specs and not self.sampling.holds(adapter):
                raise AdapterGone(f"no adapter {adapter!r} on this learner (it restarted, or the model was unloaded)")
            self.switch.use(self.model, adapter)

    def _train_mode(self) -> None:
        if not self.training:  # model.train() walks every module: only after a sample switched to eval
            self.model.train()
            self.training = True

    def eval_mode(self, model: torch.nn.Module) -> None:
        """``model`` (this learner's, or its base) in eval mode for sampling: the next training call switches back."""
        model.eval()
        self.training = False

    def _params(self, adapter: str) -> list[torch.nn.Parameter]:
        self.optim.check(adapter)  # (refused after an update that failed behind its answer)
        return self.switch.params(self.model, adapter)

    # ------------------------------------------------------------------ forward / backward

    def forward_backward(self, adapter: str, datums: list[Datum], loss_fn: str, loss_fn_config: Optional[dict[str, float]]
                         = None, backward: bool = True, graph: Optional[LossGraph] = None) -> PassResult:
        """Add the gradient of ``sum(per-token loss)`` over every datum to ``adapter``'s gradients
        (``backward=False``: the same numbers, no gradient). Datums with K targets per position
        (``target_k``) give back K logprobs per position, flattened. ``graph``: a custom loss instead."""
        self.use(adapter)
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
        """Several clients' requests (of one :meth:`PassRequest.pack_key`) in shared passes
        (:class:`~otray.tinker.learner.shared_pass.SharedPass`): each request gets what :meth:`forward_backward`
        alone gives it (float rounding aside). A request whose adapter is gone or whose loss fails gets its
        exception back, alone; a pass failing before any gradient was added raises
        :class:`~otray.tinker.learner.shared_pass.PassNotRun` (the
        caller runs the requests one by one)."""
        live = next((r.adapter for r in requests if r.adapter in self.specs), None)
        if live is not None:
            self._train_mode()
            self.use(live)  # PEFT's own record of the active adapter must name a live one
            self.routing.install(self.switch.lora_layers(self.model))
            if self.graph_passes and self.graphs is None:
                self.graphs = PassGraphs(self.model, self.routing, self.bank, self.gate, self.device,
                                         capture=self.device.startswith("cuda"), max_tokens=GRAPH_TOKENS)
        return SharedPass(self.model, self.routing, self.device, self.micro_batch_tokens,
                          {n: s.rank for n, s in self.specs.items()}, self._params, self.graphs).run(requests)

    def optim_step(self, adapter: str, p: AdamStep) -> Answer:
        """One AdamW step of ``adapter`` on its accumulated gradients; zeroes them."""
        self.use(adapter)
        return self.optim.step(adapter, self._params(adapter), p)

    def optim_many(self, works: list[tuple[str, AdamStep]]) -> list[Answer | Exception]:
        """Several adapters' optimizer steps, each as :meth:`optim_step` gives it (:meth:`optim_answers`, then
        its update)."""
        outs, update = self.optim_answers(works)
        update()
        return outs

    def optim_answers(self, works: list[tuple[str, AdamStep]]) -> tuple[list[Answer | Exception], Callable[[], None]]:
        """:meth:`optim_many` in two halves (:meth:`AdapterSteps.answers`): each step's answer, and the update
        that must run next on this thread (the SharedLearner answers first and updates while the answers
        travel). Adapters past their first step go in one fused AdamW call (8 rank-32 adapters of the tiny
        model took 13 ms one by one); an adapter that is gone gets its error, alone."""
        live = (lambda a: self._params(a) if a in self.specs and a not in self.optim.failed else None)
        return self.optim.answers(works, live, self.optim_step)

    # ------------------------------------------------------------------ checkpoints

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        self.optim.check(adapter)
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model, adapter_name=adapter,
                                                                              save_embedding_layers=False).items()}

    def save(self, adapter: str, path: str, optimizer: bool, version: Optional[int] = None) -> int:
        """``adapter`` as a PEFT directory at ``path`` (loadable by transformers, vLLM and ``otray serve``),
        with its optimizer state when ``optimizer`` and ``version`` in its metadata (an inflight target's,
        which samples report); returns the bytes written."""
        self.optim.check(adapter)  # weights an update left half-done are not saved
        out = Path(path)
        shutil.rmtree(out, ignore_errors=True)  # overwritten: new files, never the old ones rewritten in place (a
        out.mkdir(parents=True)  # hard link of them, a copied checkpoint's or a restore point's, keeps what it linked)
        self.sampling.slots.forget(str(out))  # what is loaded from it is stale
        self.use(adapter)  # PEFT's model card reads the active adapter's config: it must be a live one
        self.model.save_pretrained(str(out), selected_adapters=[adapter], safe_serialization=True,
                                   save_embedding_layers=False)  # the base's (tied) embeddings are not trained
        nested = out / adapter  # PEFT puts a non-default adapter in a subdirectory
        if nested.is_dir():
            for f in nested.iterdir():
                f.replace(out / f.name)
            nested.rmdir()
        meta = {"spec": asdict(self.specs[adapter]), "step": self.optim.steps[adapter], "base": self.model_path,
                **({"version": version} if version is not None else {})}
        (out / "otray_adapter.json").write_text(json.dumps(meta))
        if optimizer and adapter in self.optim.optimizers:
            torch.save(self.optim.optimizers[adapter].state_dict(), out / "optimizer.pt")
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
        self.optim.optimizers.pop(adapter, None)
        if optimizer:  # the state: the step count, and AdamW's moments (none saved before a first step)
            self.optim.steps[adapter] = int(meta["step"])
            if (src / "optimizer.pt").exists():
                opt = self.optim.optimizers[adapter] = new_adamw(self._params(adapter), lr=1e-4)
                opt.load_state_dict(torch.load(src / "optimizer.pt", weights_only=True, map_location=self.device))
        return spec

    # ------------------------------------------------------------------ sampling

    def sample(self, jobs: list[SampleJob], stop: Optional[Callable[[], bool]] = None) -> list[list[SampleOut]]:
        """Each job's prompts sampled on this model (:meth:`LearnerSampling.sample`)."""
        return self.sampling.sample(jobs, stop)

    def sample_run(self, jobs: list[SampleJob], stop: Optional[Callable[[], bool]] = None,
                   turn_s: Optional[float] = None, wanted: Optional[Callable[[], bool]] = None) -> SampleRun:
        """:meth:`sample`'s call, run a turn at a time, each up to its first decode step past ``turn_s`` seconds at
        which ``wanted()`` says True (:class:`SampleRun`)."""
        return self.sampling.run(jobs, stop, turn_s, wanted)
