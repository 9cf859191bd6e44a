"""The interface every generation backend implements (vLLM, HF transformers).

A backend is an in-process object; :class:`otray.actors.sampling.rollout.RolloutWorker`
wraps one in a Ray actor. Prompts are token ids, never text: the ids a backend
returns are exactly the ids the learner trains on.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from otray.types import FinishReason, PromptTooLongError, Sample, SamplingParams


class Backend(Protocol):
    name: str
    max_model_len: int
    stop_token_ids: list[int]

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[list[Sample]]:
        """``n`` samples per prompt, each with per-token logprobs (temperature 1) and finish reason."""

    def load_full_weights(self, tensors: dict[str, Any]) -> None:
        """Replace all weights in place (Hugging Face parameter names)."""

    def load_lora(self, tensors: dict[str, Any], lora_config: dict[str, Any], version: int) -> None:
        """Activate a LoRA adapter for every later ``generate`` call."""


def check_prompt_lengths(prompts: list[list[int]], max_model_len: int) -> None:
    """Raise PromptTooLongError naming the first prompt that leaves no room to generate."""
    for i, p in enumerate(prompts):
        if not p:
            raise PromptTooLongError(f"prompt {i} is empty: a prompt needs at least one token")
        if len(p) >= max_model_len:
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens but the model context is {max_model_len}: "
                "shorten the prompt or raise rollout.max_model_len")


def effective_params(params: SamplingParams, stop_token_ids: list[int]) -> SamplingParams:
    """``params`` with the backend's end-of-turn ids when none were given."""
    from dataclasses import replace

    if params.ignore_eos:
        return replace(params, stop_token_ids=())
    if params.stop_token_ids:
        return params
    return replace(params, stop_token_ids=tuple(stop_token_ids))


def stop_string_end(decode: Callable[[list[int]], str], ids: list[int], stops: Sequence[str]) -> int | None:
    """How many of ``ids`` to keep when their text reaches one of ``stops``: up to and including the
    token that completes the first stop string; None when the text holds none."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    for k in range(1, len(ids) + 1):
        if any(s in decode(ids[:k]) for s in stops):
            return k
    return None


def apply_stop_strings(sample: Sample, decode: Callable[[list[int]], str], stops: Sequence[str]) -> Sample:
    """``sample`` cut after the token that completed a stop string (finish reason ``stop_string``), or
    as it is when its text reaches none (or an end-of-turn token ended it on the same token)."""
    k = stop_string_end(decode, sample.token_ids, stops)
    if k is None or (sample.finish_reason is FinishReason.STOP and k == len(sample.token_ids)):
        return sample
    return dataclasses.replace(sample, token_ids=sample.token_ids[:k], logprobs=sample.logprobs[:k],
                               finish_reason=FinishReason.STOP_STRING)
