"""The valid range of every numeric config field, checked when a config loads (so at submit).

One table per schema: ``RANGES`` for jobs (``otray.config``), ``SERVE_RANGES`` and ``TINKER_RANGES``
for the two services' configs. Each maps a dotted key (``*`` for any env name or list item) ->
(lowest, highest), either end ``None`` for open; ``GT`` marks a strict lower bound (``> 0``).
Optional fields may be null.
A value outside its range is a ConfigError naming the key, the value and the range, before
anything reaches the cluster (a negative temperature used to pass submit and fail 30 s in).
"""

from __future__ import annotations

import math
from typing import Any

from otray.types import ConfigError


class GT(float):
    """A strict lower bound: the value must be greater than it."""


_ENV = {  # one env's sampling and episode limits (envs.*) ...
    "num_rollouts": (1, None), "max_failing_rollouts": (0, None), "temperature": (0, None),
    "top_p": (GT(0), 1), "weight": (0, None), "max_turns": (1, None), "max_tokens_per_turn": (1, None),
    "max_tokens_per_episode": (1, None), "max_concurrency": (1, None), "timeout_s": (GT(0), None),
    "episode_timeout_s": (GT(0), None), "max_rollout_retries": (0, None),
}
_GAME = {  # ... and a game's
    "num_rollouts": (1, None), "max_failing_rollouts": (0, None), "max_retries": (0, None),
    "temperature": (0, None), "max_tokens_per_turn": (1, None), "max_tokens_per_episode": (1, None),
    "eval_games": (1, None),
}

RANGES: dict[str, tuple[Any, Any]] = {
    "model.lora.rank": (0, None), "model.lora.alpha": (GT(0), None), "model.lora.dropout": (0, 1),
    "rollout.num_workers": (1, None), "rollout.max_model_len": (8, None), "rollout.kv_cache_gb": (1, None),
    "rollout.max_batch": (1, None),
    "resources.learner_cpus": (0, None), "resources.rollout_cpus": (0, None),
    "resources.learner_gpus": (0, None), "resources.rollout_gpus": (0, None),
    "resources.learner_threads": (1, None), "resources.rollout_threads": (1, None),
    "resources.learner_workers": (1, None), "resources.collective_timeout_s": (GT(0), None),
    "algo.learning_rate": (0, None), "algo.weight_decay": (0, None), "algo.grad_clip": (0, None),
    "algo.steps": (0, None), "algo.batch_size": (1, None),
    "algo.micro_batch_tokens": (0, None),  # 0: derived from the free GPU memory (8192 on the CPU)
    "rollout.gpu_memory_utilization": (GT(0), 1),
    "algo.max_steps_off_policy": (0, 1),  # 0: on-policy; 1: the next batch is sampled while the learner trains
    "eval.every": (0, None), "eval.num_samples": (1, None),
    "sft.steps": (0, None), "sft.batch_size": (1, None), "sft.learning_rate": (0, None),
    "sft.warmup_steps": (0, None), "sft.stop_at_accuracy": (0, 1), "sft.check_every": (1, None),
    "sft.check_samples": (1, None), "sft.eval_samples": (1, None),
    "checkpoint.save_every": (0, None), "infer.limit": (1, None),
    **{f"envs.*.{k}": v for k, v in _ENV.items()},
    "envs.*.splits.*.num_samples": (1, None), "sft.splits.*.num_samples": (1, None),
    **{f"game.{k}": v for k, v in _GAME.items()},
}

SERVE_RANGES: dict[str, tuple[Any, Any]] = {  # ``otray serve`` (otray.serve.config)
    "port": (1, 65535), "max_n": (1, None), "max_tokens": (1, None), "request_timeout_s": (GT(0), None),
    "models.*.max_loaded_checkpoints": (1, None), "models.*.num_replicas": (1, None),
    "models.*.max_lora_rank": (0, None),  # 0: LoRA checkpoints are merged into the base
}

TINKER_RANGES: dict[str, tuple[Any, Any]] = {  # ``otray tinker`` (otray.tinker.config)
    "port": (1, 65535), "long_poll_s": (GT(0), 40),  # the SDK gives up on a poll after 45 s
    "result_ttl_s": (GT(0), None), "gap_timeout_s": (GT(0), None), "session_timeout_s": (GT(0), None),
    "max_body_bytes": (1, None), "sample_batch_wait_ms": (0, None), "max_chunk_datums": (1, None),
    "max_samples": (1, None), "max_tokens": (1, None),
    "models.*.learner_cpus": (GT(0), None), "models.*.max_rank": (1, None), "models.*.lora_alpha": (GT(0), None),
    "models.*.sampler.cpus": (GT(0), None), "models.*.sampler.max_lora_rank": (1, None),
    "models.*.sampler.max_loras": (1, None), "models.*.sampler.start_timeout_s": (GT(0), None),
}


def _values(obj: Any, parts: list[str], key: str) -> list[tuple[str, Any]]:
    """Every (concrete key, value) that the dotted pattern ``parts`` reaches in ``obj``."""
    if not parts:
        return [(key, obj)]
    head, rest = parts[0], parts[1:]
    if head == "*":
        if isinstance(obj, (list, tuple)):
            return [kv for i, child in enumerate(obj) for kv in _values(child, rest, f"{key}[{i}]")]
        items = obj.items() if isinstance(obj, dict) else []
        return [kv for name, child in items for kv in _values(child, rest, f"{key}.{name}")]
    child = obj.get(head) if isinstance(obj, dict) else getattr(obj, head, None)
    return [] if child is None else _values(child, rest, f"{key}.{head}" if key else head)


def check_ranges(cfg: Any, table: dict[str, tuple[Any, Any]] | None = None) -> None:
    """Raise ConfigError for the first numeric field outside its range in ``table`` (default: the
    job table, ``RANGES``); nulls pass."""
    for pattern, (low, high) in (RANGES if table is None else table).items():
        for key, value in _values(cfg, pattern.split("."), ""):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            strict = isinstance(low, GT)
            bad = (not math.isfinite(value) or (low is not None and (value <= low if strict else value < low))
                   or (high is not None and value > high))
            if bad:
                lo = "" if low is None else (f"> {float(low):g}" if strict else f">= {low:g}")
                hi = "" if high is None else f"<= {high:g}"
                raise ConfigError(f"{key} must be {' and '.join(x for x in (lo, hi) if x)}, got {value!r}")
