"""Hugging Face transformers backend: batched ``generate`` with KV cache.

Prompts are left-padded into batches of at most ``max_batch`` rows. Logprobs come
from the raw logits of each step (before temperature / top-p processing), i.e.
the temperature-1 distribution the learner also computes. They are taken step by step
(:class:`~otray.actors.sampling.backends.hf_logits.ChosenLogprobs`, first in the logits processors; temperature,
top-k, top-p and the minimum length come after it): one step's log-softmax is held at a time, never every step's
full-vocabulary logits (at a 151,936-token vocabulary, 256 rows x 512 steps of fp32 logits are
~80 GB). On CPU the linear layers sample through oneDNN's prepacked kernels (``packed.py``;
``packed_linears=False`` turns that off).

``sampler`` (``rollout.sampler``): ``eager`` is transformers' ``generate`` above; ``compiled`` is
``compiled.py``'s static-cache decode step, compiled once at start (text prompts; a call with images
goes through ``generate``); ``auto`` = compiled on a GPU, eager on the CPU, where the compiled step
measured slower (NOTES.md). Jobs pass ``rollout.sampler`` (default ``auto``); other users of the
backend (serve, the Tinker sampler, ``otray.local``) sample eagerly unless they ask.

A call can be decoded in turns (:meth:`HFBackend.turns`, :mod:`hf_turns`): the Tinker learner runs other users'
steps between them; :meth:`HFBackend.generate` runs every turn at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from otray.actors.sampling.backends.compiled import CompiledSampler, MergedLora, choose_sampler
from otray.actors.sampling.backends.hf_turns import Turns
from otray.actors.sampling.backends.packed import PackedLinears
from otray.device import resolve_device, resolve_dtype
from otray.models import end_of_turn_ids, load_model, load_tokenizer
from otray.types import Sample, SamplingParams
from otray.vision import Image
from otray.vlm import FeatureCache


@dataclass(frozen=True)
class Sampling:
    """Which sampler a backend runs (``rollout.sampler``), the dtype the model computes in (None: its
    parameters'), and the ``torch.compile`` backend of the compiled one (tests use ``eager``: dynamo's
    graph capture without inductor's code generation)."""

    setting: str = "auto"
    dtype: torch.dtype | None = None
    compile_backend: str = "inductor"


class HFBackend:
    name = "hf"

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len: int | None = None,
                 max_batch: int = 256, seed: int = 0, packed_linears: bool = True, device: str = "auto",
                 sampler: str = "eager", compile_backend: str = "inductor", **_: Any):
        torch.manual_seed(seed)  # sampling without a per-call seed draws from this process's RNG
        where = resolve_device(device)  # the GPU Ray gave this worker, else the CPU (otray.device)
        model = load_model(model_path, resolve_dtype(dtype, where)).eval()
        if where != "cpu":
            model.to(where)
        # oneDNN's prepacked kernels are the CPU's; a GPU samples with the model's own layers
        self._attach(model, load_tokenizer(model_path), max_model_len, max_batch, packed_linears and where == "cpu",
                     owned=True, sampler=Sampling(sampler, None, compile_backend))

    @classmethod
    def on_model(cls, model: Any, tokenizer: Any, *, max_model_len: int | None = None,
                 max_batch: int = 256, packed_linears: bool = True,
                 weights_version: Callable[[], Any] | None = None, sampler: str = "eager",
                 dtype: torch.dtype | None = None, compile_backend: str = "inductor") -> "HFBackend":
        """A backend that samples from ``model`` as it is (a learner's model, trained in place):
        nothing is loaded or copied (but the packed sampling weights, rebuilt whenever
        ``weights_version()`` changes), and the process's RNG is left alone. ``dtype``: the dtype the
        model computes in when it differs from its parameters' (a learner under autocast)."""
        backend = cls.__new__(cls)
        backend._attach(model, tokenizer, max_model_len, max_batch, packed_linears, weights_version,
                        sampler=Sampling(sampler, dtype, compile_backend))
        return backend

    def _attach(self, model: Any, tokenizer: Any, max_model_len: int | None, max_batch: int,
                packed_linears: bool, weights_version: Callable[[], Any] | None = None, owned: bool = False,
                sampler: "Sampling | None" = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.dtype = str(model.dtype).removeprefix("torch.")  # what the learner sends (WorkerInfo.dtype)
        self.base_model = self.model
        self.max_model_len = max_model_len or self.model.config.get_text_config().max_position_embeddings
        self.max_batch = max_batch
        self.stop_token_ids = end_of_turn_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        sampler = sampler or Sampling("eager")
        self.sampler = choose_sampler(sampler.setting, model, str(model.device))
        self.compiled: CompiledSampler | None = None
        self.merged: MergedLora | None = None
        if self.sampler == "compiled":  # warmed up here: the compile is paid when the worker starts
            self.compiled = CompiledSampler(model, max_model_len=self.max_model_len, max_batch=max_batch,
                                            pad_id=self.pad_id, stop_token_ids=self.stop_token_ids,
                                            dtype=sampler.dtype, backend=sampler.compile_backend)
            self.compiled.warm_up()
            self.merged = MergedLora(model)
            packed_linears = False
        self.packed = PackedLinears(weights_version) if packed_linears else None
        # the vision tower once per distinct image (a vision-language model); a model trained in place
        # (on_model, not ``owned``) keeps features across calls only where weights_version() tells of changes
        self.features = FeatureCache(version=weights_version, across_calls=owned or weights_version is not None)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 images: list[Sequence[Image]] | None = None,
                 stop: Callable[[], bool] | None = None) -> list[list[Sample]]:
        """``images[i]``: prompt i's images, whose expanded image tokens it holds (a vision-language model).
        ``stop``: asked between tokens; once it says True the call ends early, every sample cut where it
        was and the batches not begun left empty (its caller abandoned the call: the sampler is free again)."""
        call = self.turns(prompts, params, n, images, stop)
        while not call.turn():
            pass
        return call.result()

    def turns(self, prompts: list[list[int]], params: SamplingParams, n: int,
              images: list[Sequence[Image]] | None = None, stop: Callable[[], bool] | None = None,
              turn_s: float | None = None, wanted: Callable[[], bool] | None = None,
              turn_tokens: int | None = None) -> Turns:
        """:meth:`generate`'s call to be run a turn at a time (:class:`~otray.actors.sampling.backends.hf_turns.Turns`:
        a turn ends at its first decode step past ``turn_s`` seconds at which ``wanted()`` says True, or after
        ``turn_tokens`` decode steps; None for both: a batch a turn), its samples equal to an uncut call's."""
        return Turns(self, prompts, params, n, images, stop, turn_s, wanted, turn_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def load_full_weights(self, tensors: dict[str, Any]) -> None:
        if self.model is not self.base_model:
            # PEFT injected LoRA layers into the base model in place: take them out first
            self.base_model = self.model.unload()
            self.model = self.base_model
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)  # copied into the same tensors
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise ValueError(f"weight update does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")
        if self.merged is not None:
            self.merged.forget_base()
        self._weights_changed()

    @property
    def compile_s(self) -> float:
        """Seconds the compiled sampler's warm-up took (0: eager)."""
        return self.compiled.compile_s if self.compiled is not None else 0.0

    def held(self, kind: str, names: tuple[str, ...]) -> dict[str, Any]:
        """The tensors ``names`` as the sampler holds them now (an update's checksum is checked on these):
        the model's parameters (``full``), or the adapter's, as loaded or as merged from (``lora``)."""
        if kind == "lora":
            if self.merged is not None:
                return {n: self.merged.adapter[n] for n in names if n in self.merged.adapter}
            from peft import get_peft_model_state_dict

            held = get_peft_model_state_dict(self.model) if self.model is not self.base_model else {}
        else:
            held = self.model.state_dict()
        return {n: held[n] for n in names if n in held}

    def _weights_changed(self) -> None:
        if self.packed:
            self.packed.invalidate()
        self.features.clear()

    def load_lora(self, tensors: dict[str, Any], lora_config: dict[str, Any], version: int) -> None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        if self.merged is not None:  # the compiled step keeps its graph: the adapter goes into the weights
            self.merged.apply(tensors, lora_config)
            self._weights_changed()
            return
        if self.model is self.base_model:
            config = LoraConfig(**{k: v for k, v in lora_config.items() if k in LoraConfig.__dataclass_fields__})
            self.model = get_peft_model(self.base_model, config).eval()
        set_peft_model_state_dict(self.model, tensors)
        self._weights_changed()
