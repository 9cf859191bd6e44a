"""The compiled sampler (``rollout.sampler: compiled``): prefill, then one decode step over a static KV
cache, compiled once and replayed for every new token.

Runs in whichever process samples with the HF backend: a rollout worker, or a learner that samples
(``rollout.colocate``). The decode step (:meth:`StaticDecoder.decode`) is compiled with
``torch.compile`` (``mode="reduce-overhead"``, i.e. CUDA graphs, on a GPU), once, with the row count
dynamic; rows are padded to a bucket size (powers of two from 8 up to ``max_batch``) so that the step
only ever sees those shapes (a CUDA graph is recorded per bucket). After the warm-up
(:meth:`CompiledSampler.warm_up`, run when the sampler starts and timed) a call recompiles nothing, a
weight update neither (weights are loaded into the same tensors: ``load_full_weights`` and
:class:`MergedLora`). Choosing the token (temperature, min-p, top-k, top-p, end ids ruled out under
``ignore_eos``) runs eagerly on the step's logits; only the chosen token's raw (temperature-1) logprob
is kept, as the eager sampler does. Stop ids end a row; stop strings are looked for every
``CHECK_EVERY`` steps and cut exactly afterwards (``base.apply_stop_strings``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch._dynamo

from otray.actors.sampling.backends.static_decoder import StaticDecoder, language_model, unsupported
from otray.types import ConfigError, FinishReason, Sample, SamplingParams

SAMPLERS = ("auto", "eager", "compiled")
CHECK_EVERY = 8  # decode steps between looks at which rows are done (each look waits for the device)


SMALLEST = 8  # rows: fewer are padded up to it (on a GPU eight rows cost what one does; each bucket is a compile)


def buckets(max_batch: int) -> tuple[int, ...]:
    """The row counts a decode step runs at: powers of two from ``SMALLEST`` below ``max_batch``, then
    ``max_batch``."""
    out, b = [], SMALLEST
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int:
    return next(b for b in sizes if b >= rows)


def compiled_reason(model: Any) -> str | None:
    """Why ``rollout.sampler: compiled`` cannot sample ``model`` (None: it can)."""
    from otray.models import is_vision_config

    if is_vision_config(language_model(model).config):
        return "a vision-language model (its image features enter the first pass)"
    return unsupported(model)


def choose_sampler(setting: str, model: Any, device: str) -> str:
    """``eager`` or ``compiled`` for ``rollout.sampler=setting`` on ``model`` (see ``hf.py``): ``auto`` is
    compiled on a GPU when the model allows it; ``compiled`` on a model it cannot run is an error."""
    if setting not in SAMPLERS:
        raise ConfigError(f"rollout.sampler={setting!r}: choose one of {', '.join(SAMPLERS)}")
    why = compiled_reason(model)
    if setting == "compiled" and why is not None:
        raise ConfigError(f"rollout.sampler=compiled cannot sample {why}: set rollout.sampler to eager or auto")
    if setting == "auto":
        return "compiled" if device.startswith("cuda") and why is None else "eager"
    return setting


class CompiledSampler:
    """Sampling from ``model`` (a causal LM, possibly PEFT-wrapped) over a static cache."""

    def __init__(self, model: Any, *, max_model_len: int, max_batch: int, pad_id: int, stop_token_ids: list[int],
                 dtype: torch.dtype | None = None, compile: bool = True, backend: str = "inductor"):
        """``dtype``: what the cache holds, the dtype the model computes in (default: its parameters';
        a learner that computes under autocast gives its autocast dtype)."""
        param = next(model.parameters())
        self.device = param.device
        dtype = dtype or param.dtype
        self.model = model
        self.sizes = buckets(max_batch)
        self.length = max_model_len
        self.pad_id = pad_id
        self.stop_token_ids = list(stop_token_ids)
        self.decoder = StaticDecoder(model, max_batch, max_model_len, dtype, self.device)
        cuda = self.device.type == "cuda"
        if compile:
            # the limit counts the graphs of one code object (``decode``) over every sampler of the process
            torch._dynamo.config.recompile_limit += len(self.sizes) + 2
            self.step = torch.compile(self.decoder.decode, backend=backend, fullgraph=True, dynamic=None,
                                      mode="reduce-overhead" if cuda and backend == "inductor" else None)
        else:
            self.step = self.decoder.decode
        self.graphs = cuda and compile and backend == "inductor"
        self.dynamic_rows = compile and len(self.sizes) > 1 and min(self.sizes) >= SMALLEST
        self.compile_s = 0.0  # seconds of the warm-up (compiling and capturing every bucket)

    @torch.inference_mode()
    def warm_up(self, sizes: tuple[int, ...] | None = None) -> float:
        """Compile (and capture) the decode step at every bucket size; returns and keeps the seconds."""
        t0 = time.perf_counter()
        for b in sizes or self.sizes:
            ids = torch.full((b,), self.pad_id, dtype=torch.long, device=self.device)
            for k in range(3):  # CUDA graph trees record on the second call, replay from the third
                self._run(ids, torch.full((b,), k, dtype=torch.long, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - t0
        return self.compile_s

    def _run(self, ids: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.dynamic_rows:  # one compile for every bucket (CUDA graphs still record one per bucket)
            torch._dynamo.mark_dynamic(ids, 0, min=SMALLEST, max=self.sizes[-1])
            torch._dynamo.mark_dynamic(slot, 0, min=SMALLEST, max=self.sizes[-1])
        return self.step(ids, slot)

    @torch.inference_mode()
    def sample(self, rows: list[list[int]], params: SamplingParams, decode_text: Any = None,
               stop: Optional[Callable[[], bool]] = None) -> list[Sample]:
        """One sample per row (``len(rows) <= max_batch``); ``params`` as the eager sampler takes them
        (``base.effective_params`` applied); ``decode_text``: ids -> text, for ``params.stop``; ``stop``:
        asked every few steps, True ends the call with every sample cut where it is."""
        n = len(rows)
        b = bucket_for(n, self.sizes)
        padded = rows + [rows[0]] * (b - n)  # filler rows: sampled and dropped
        lengths = torch.tensor([len(r) for r in padded], device=self.device)
        width = int(lengths.max())
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(padded):
            ids[i, :len(r)] = torch.tensor(r)
        ids = ids.to(self.device)
        limits = torch.tensor([min(params.max_tokens, self.length - len(r)) for r in padded], device=self.device)
        steps = int(limits[:n].max())
        choose = Chooser(params, self.stop_token_ids, self.device)
        # step-major, so that each step's tokens are one contiguous row (the compiled step's input)
        tokens = torch.full((max(steps, 1), b), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((max(steps, 1), b), dtype=torch.float32, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        done[n:] = True
        stops = torch.tensor(list(params.stop_token_ids) or [-1], device=self.device)
        logits = self.decoder.prefill(ids, lengths)
        for t in range(steps):
            tok, lp = choose(logits)
            tokens[t] = torch.where(done, self.pad_id, tok)
            logprobs[t] = torch.where(done, 0.0, lp)
            done = done | torch.isin(tok, stops) | (t + 1 >= limits)
            if t + 1 == steps:
                break
            if (t + 1) % CHECK_EVERY == 0:
                if stop is not None and stop():
                    limits = limits.clamp(max=t + 1)
                    break
                if params.stop and decode_text is not None:
                    done = done | self._stop_strings(tokens[:t + 1].T, done, params.stop, decode_text)
                if bool(done.all()):
                    break
            logits = self._run(tokens[t], (lengths + t).clamp(max=self.length - 1))
        return self._samples(tokens.T.cpu(), logprobs.T.cpu(), limits.cpu(), n, params)

    def _stop_strings(self, tokens: torch.Tensor, done: torch.Tensor, stop: Any, decode_text: Any) -> torch.Tensor:
        hit = torch.zeros_like(done)
        host, finished = tokens.cpu().tolist(), done.cpu().tolist()
        for i, row in enumerate(host):
            if not finished[i] and any(s in decode_text(row) for s in stop):
                hit[i] = True
        return hit

    def _samples(self, tokens: torch.Tensor, logprobs: torch.Tensor, limits: torch.Tensor, n: int,
                 params: SamplingParams) -> list[Sample]:
        stops = set(params.stop_token_ids)
        out = []
        for i in range(n):
            toks, lps, reason = [], [], FinishReason.LENGTH
            for t, lp in zip(tokens[i, :int(limits[i])].tolist(), logprobs[i, :int(limits[i])].tolist()):
                toks.append(t)
                lps.append(lp)
                if t in stops:
                    reason = FinishReason.STOP
                    break
            out.append(Sample(toks, lps, reason))
        return out


class Chooser:
    """One step's choice of token from the float32 logits: raw logprobs first, then what shapes the
    sampling distribution (end ids ruled out under ``ignore_eos``, temperature, min-p, top-k, top-p)."""

    def __init__(self, params: SamplingParams, end_ids: list[int], device: torch.device):
        self.params = params
        self.forbid = torch.tensor(end_ids, device=device) if params.ignore_eos and end_ids else None
        self.generator = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        raw = logits.log_softmax(-1)
        scores = logits if self.forbid is None else logits.index_fill(-1, self.forbid, float("-inf"))
        if p.greedy:
            tok = scores.argmax(-1)
        else:
            if p.temperature != 1.0:
                scores = scores / p.temperature
            if p.min_p > 0.0:  # under min_p times the likeliest token: out (after temperature, as vLLM)
                probs = scores.softmax(-1)
                scores = scores.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
            if p.top_k > 0:
                kth = scores.topk(min(p.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if p.top_p < 1.0:
                ordered, index = scores.sort(dim=-1)
                cut = ordered.softmax(-1).cumsum(-1) <= 1.0 - p.top_p
                cut[:, -1] = False
                scores = scores.scatter(-1, index, ordered.masked_fill(cut, float("-inf")))
            tok = torch.multinomial(scores.softmax(-1), 1, generator=self.generator).squeeze(-1)
        return tok, raw.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


class MergedLora:
    """A LoRA adapter applied by adding ``scale * B @ A`` into the base model's weights in place (the
    compiled sampler's graph stays valid); the base weights it changed are kept to apply the next one."""

    PREFIX = "base_model.model."

    def __init__(self, model: Any):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # parameter name -> its weight before any adapter
        self.adapter: dict[str, torch.Tensor] = {}  # the adapter applied last, as received

    def forget_base(self) -> None:
        """New base weights were loaded: the kept copies are stale."""
        self.base.clear()
        self.adapter.clear()

    @torch.no_grad()
    def apply(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError("a LoRA update with rank_pattern or alpha_pattern: the compiled sampler merges one "
                             "rank and alpha for every module; set rollout.sampler: eager")
        r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
        scale = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
        modules = sorted({k.rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k})
        other = [k for k in tensors if ".lora_A." not in k and ".lora_B." not in k]
        if other:
            raise ValueError(f"a LoRA update with weights other than lora_A/lora_B ({other[:3]}): the compiled "
                             "sampler merges plain LoRA adapters only; set rollout.sampler: eager")
        for name in list(self.base):  # modules of the last adapter that this one leaves out
            if name.removesuffix(".weight") not in {m.removeprefix(self.PREFIX) for m in modules}:
                self.model.get_parameter(name).copy_(self.base.pop(name))
        for module in modules:
            name = module.removeprefix(self.PREFIX) + ".weight"
            weight = self.model.get_parameter(name)
            if name not in self.base:
                self.base[name] = weight.detach().clone()
            a = tensors[f"{module}.lora_A.weight"].to(weight.device, torch.float32)
            b = tensors[f"{module}.lora_B.weight"].to(weight.device, torch.float32)
            weight.copy_((self.base[name].float() + scale * (b @ a)).to(weight.dtype))
        self.adapter = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
