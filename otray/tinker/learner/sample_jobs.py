"""What the learner samples and what it answers: :class:`SampleJob` (prompts that share a sampler and
settings) and :class:`SampleOut` (one prompt's samples, prompt logprobs, scores and the weights' version),
shared by the learner's and the vLLM sampler's ``sample``; :func:`scores_of` computes a prompt's scores from
the learner's own forward pass.

Runs in the SharedLearner and LoraSampler actors (and the TinkerService, which builds the jobs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from otray.tinker.learner.prompt_scores import PromptScores, Scoring, Targets, score
from otray.types import Datum, Sample, SamplingParams

if TYPE_CHECKING:  # the TinkerService builds jobs without torch; the learner's scores_of needs it
    import torch


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
    from otray.actors.learner.core import position_log_softmax

    images = tuple(job.images[i]) if job.images else ()

    def position_logprobs(tokens: list[int]) -> torch.Tensor:
        n = len(tokens) - 1
        return position_log_softmax(model, Datum(tokens[:-1], tokens[1:], [1.0] * n, [0.0] * n, [0.0] * n,
                                                 images=images), device)

    return score(position_logprobs, job.prompts[i], job.scoring, job.targets[i] if job.targets else None,
                 job.params.temperature, job.params.seed, samples)
