"""What shapes and records the choices of an HF ``generate`` call: :class:`ChosenLogprobs` (the raw logprob of
each chosen token), :class:`NeverSample`, the sampling settings' logits processors (:func:`processors`) and
:class:`StopWhen` (a caller's abandoning of the call).

Runs wherever an :class:`~otray.actors.sampling.backends.hf.HFBackend` runs."""

from __future__ import annotations

from typing import Any, Callable

import torch

from otray.types import SamplingParams
from otray.vlm import NEVER


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
