"""The Tinker SDK's sampling wire formats: its ``SamplingParams`` JSON in, ``SampleResponse``
protobuf out (the training side's are in :mod:`otray.tinker.wire.messages`).

Runs in the TinkerService actor (sampling parameters in, SampleResponse out)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from otray.tinker.wire.messages import pb
from otray.tinker.errors import UserError
from otray.types import FinishReason, Sample, SamplingParams


def sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """Tinker's ``SamplingParams`` JSON -> otray's. ``stop``: None keeps the end-of-turn tokens, ``[]``
    stops at nothing (exactly ``max_tokens``), strings or token ids replace them."""
    stop = raw.get("stop")
    strings: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and stop:
        if all(isinstance(s, str) for s in stop):
            strings = tuple(stop)
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            ids = tuple(stop)
        else:
            raise UserError(f"sampling_params.stop mixes strings and token ids: {stop!r}; send one kind")
    elif stop not in (None, []):
        raise UserError(f"sampling_params.stop must be a string, a list of strings or of token ids; got {stop!r}")
    try:
        return SamplingParams(max_tokens=int(raw.get("max_tokens") or 64), temperature=float(raw.get("temperature", 1.0)),
                              top_p=float(raw.get("top_p", 1.0)), top_k=int(raw.get("top_k", -1)),
                              seed=raw.get("seed"), stop_token_ids=ids, stop=strings,
                              ignore_eos=isinstance(stop, list) and not stop)
    except (TypeError, ValueError) as e:
        raise UserError(f"sampling_params: {e}") from None


def sample_output(samples: list[Sample], prompt_logprobs: Optional[list[Optional[float]]],
                  fill: Optional[Callable[[Any, Any], None]] = None) -> bytes:
    """A ``SampleResponse`` protobuf. The stop token (id or the one completing a stop string) is in
    ``tokens``; finish reason ``length`` maps to LENGTH, anything else to STOP. ``fill(pb module,
    response)`` writes the rest (top-K, targets, alternative tokens: :mod:`otray.tinker.learner.prompt_scores`)."""
    p = pb()
    out = p.SampleResponse()
    for s in samples:
        seq = out.sequences.add()
        seq.stop_reason = p.STOP_REASON_LENGTH if s.finish_reason is FinishReason.LENGTH else p.STOP_REASON_STOP
        seq.tokens = np.asarray(s.token_ids, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    out.prompt_cache_hit_tokens = samples[0].cached_prompt_tokens if samples else 0  # counted once per prompt
    if prompt_logprobs is not None:
        vals = [math.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(vals, dtype=np.float32).tobytes()
    if fill is not None:
        fill(p, out)
    return out.SerializeToString()
