"""Hugging Face transformers backend: batched ``generate`` with KV cache.

Prompts are left-padded into batches of at most ``max_batch`` rows. Logprobs come
from the raw logits of each step (before temperature / top-p processing), i.e.
the temperature-1 distribution the learner also computes. They are taken step by step
(:class:`ChosenLogprobs`, first in the logits processors; temperature, top-k, top-p and the
minimum length come after it): one step's log-softmax is held at a time, never every step's
full-vocabulary logits (at a 151,936-token vocabulary, 256 rows x 512 steps of fp32 logits are
~80 GB). On CPU the linear layers sample through oneDNN's prepacked kernels (``packed.py``;
``packed_linears=False`` turns that off).

``sampler`` (``rollout.sampler``): ``eager`` is transformers' ``generate`` above; ``compiled`` is
``compiled.py``'s static-cache decode step, compiled once at start (text prompts; a call with images
goes through ``generate``); ``auto`` = compiled on a GPU, eager on the CPU, where the compiled step
measured slower (NOTES.md). Jobs pass ``rollout.sampler`` (default ``auto``); other users of the
backend (serve, the Tinker sampler, ``otray.local``) sample eagerly unless they ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from otray.actors.sampling.backends.base import apply_stop_strings, check_prompt_lengths, effective_params
from otray.actors.sampling.backends.compiled import CompiledSampler, MergedLora, choose_sampler
from otray.actors.sampling.backends.packed import PackedLinears
from otray.device import resolve_device, resolve_dtype
from otray.models import end_of_turn_ids, load_model, load_tokenizer
from otray.types import FinishReason, Sample, SamplingParams
from otray.vision import Image
from otray.vlm import NEVER, FeatureCache, unsampled_ids, vision_inputs


class ChosenLogprobs:
    """A logits processor that records the raw log-probability of each sampled token.

    ``generate`` calls it before every step's choice with the ids so far: the last id is the token
    chosen at the step before, whose log-softmax this holds; :meth:`finish` adds the last step's."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = scores.float().log_softmax(-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``(rows, steps)`` logprobs of ``new_tokens`` (the generated ids, padded after a row's end)."""
        steps = list(self.chosen)
        if self.previous is not None and len(steps) < new_tokens.shape[1]:
            steps.append(self.previous.gather(-1, new_tokens[:, len(steps):len(steps) + 1]).squeeze(-1))
        self.previous = None
        if not steps:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(steps, dim=1)


class StopWhen:
    """A stopping criterion that ends every row of a ``generate`` call once ``asked()`` says True (its
    caller abandoned the call): the rows end where they are, each cut at the tokens it has."""

    def __init__(self, asked: Callable[[], bool]):
        self.asked = asked

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.asked(), dtype=torch.bool, device=input_ids.device)


class NeverSample:
    """A logits processor that rules out ``ids`` (a vision-language policy's vision tokens, ``otray.vlm``),
    before the raw logprobs are recorded: the learner scores the same distribution."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, torch.tensor(self.ids, device=scores.device), NEVER)


def processors(params: SamplingParams, recorder: ChosenLogprobs, prompt_width: int, min_new: int,
               eos: list[int], never: list[int] | None = None, device: str = "cpu") -> Any:
    """The recorder first (after ``never``'s tokens are ruled out), then what shapes the sampling
    distribution (after the raw logprobs are taken). ``device``: the model's, where the min-new-tokens
    rule keeps its end-of-sequence ids (on a GPU, ids left on the CPU fail the first step)."""
    from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    out = LogitsProcessorList([NeverSample(never)] if never else [])
    out.append(recorder)
    if min_new:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_width, min_new, eos, device=device))
    if not params.greedy:
        if params.temperature != 1.0:
            out.append(TemperatureLogitsWarper(params.temperature))
        if params.min_p > 0.0:  # after temperature, before top-k / top-p (vLLM's order)
            out.append(MinPLogitsWarper(params.min_p))
        if params.top_k > 0:
            out.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            out.append(TopPLogitsWarper(params.top_p))
    return out


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

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 images: list[Sequence[Image]] | None = None,
                 stop: Callable[[], bool] | None = None) -> list[list[Sample]]:
        """``images[i]``: prompt i's images, whose expanded image tokens it holds (a vision-language model).
        ``stop``: asked between tokens; once it says True the call ends early, every sample cut where it
        was and the batches not begun left empty (its caller abandoned the call: the sampler is free again)."""
        check_prompt_lengths(prompts, self.max_model_len)
        params = effective_params(params, self.stop_token_ids)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        rows = [p for p in prompts for _ in range(n)]
        pictures = [im for im in (images or [()] * len(prompts)) for _ in range(n)]
        if any(pictures):
            vision = vision_inputs(self.model)
            for p, im in zip(prompts, images or []):
                vision.check_tokens(p, im)
        samples: list[Sample] = []
        for start in range(0, len(rows), self.max_batch):
            end = start + self.max_batch
            if stop is not None and stop():
                samples.extend(Sample([], [], FinishReason.LENGTH) for _ in rows[start:end])
            elif self.compiled is not None and not any(pictures[start:end]):
                samples.extend(apply_stop_strings(s, self._decode, params.stop)
                               for s in self.compiled.sample(rows[start:end], params, self._decode, stop))
            else:
                samples.extend(self._generate_batch(rows[start:end], params, pictures[start:end], stop))
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, pictures: list[Sequence[Image]],
                        stop: Callable[[], bool] | None = None) -> list[Sample]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            attn[i, width - len(r):] = 1
        if self.model.device.type != "cpu":
            ids, attn = ids.to(self.model.device), attn.to(self.model.device)
        budget = min(params.max_tokens, self.max_model_len - min(len(r) for r in rows))
        # the model's own generation defaults (a hub model's temperature, top_k, repetition penalty) are
        # overridden: what shapes sampling is ``processors``', after the raw logprobs are recorded
        sampling = {"do_sample": False, "repetition_penalty": 1.0} if params.greedy else {
            "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
        if params.stop:  # end rows early at a stop string (the exact cut is made below)
            sampling.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        if stop is not None:
            from transformers import StoppingCriteriaList

            sampling.update(stopping_criteria=StoppingCriteriaList([StopWhen(stop)]))
        eos = list(params.stop_token_ids or self.stop_token_ids)
        recorder = ChosenLogprobs()
        images = [im for row in pictures for im in row]
        if images:
            sampling.update(vision_inputs(self.model).model_kwargs(ids, pictures))
        with self.packed.active(self.model) if self.packed else nullcontext(), \
                self.features.serving(self.model, images) if images else nullcontext():
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=budget, eos_token_id=eos, pad_token_id=self.pad_id,
                logits_processor=processors(params, recorder, width, budget if params.ignore_eos else 0, eos,
                                            unsampled_ids(self.model.config), str(self.model.device)),
                return_dict_in_generate=True, **sampling)
        new = out.sequences[:, width:]
        chosen = recorder.finish(new).cpu()
        new = new.cpu()  # one host copy of each
        stops = set(params.stop_token_ids)
        result = []
        for i, r in enumerate(rows):
            limit = min(params.max_tokens, self.max_model_len - len(r))
            toks, lps, reason = [], [], FinishReason.LENGTH
            for t, lp in zip(new[i].tolist(), chosen[i].tolist()):
                if len(toks) >= limit:
                    break
                toks.append(t)
                lps.append(lp)
                if t in stops:
                    reason = FinishReason.STOP
                    break
            result.append(apply_stop_strings(Sample(toks, lps, reason), self._decode, params.stop))
        return result

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
