"""The valid range of every numeric config field, checked when a config loads (so at submit).

One table per schema: ``RANGES`` for jobs (``otray.config``), ``SERVE_RANGES`` and ``TINKER_RANGES``
for the two services' configs. Each maps a dotted key (``*`` for any env name or list item) ->
(lowest, highest), either end ``None`` for open; ``GT`` marks a strict lower bound (``> 0``).
Optional fields may be null.
A value outside its range is a ConfigError naming the key, the value and the range, before
anything reaches the cluster (a negative temperature used to pass submit and fail 30 s in). Counts
have upper bounds too, far above any real job, so that a typo (``algo.steps=1e8``, ``num_rollouts=1e5``,
``max_model_len=1e8``) is named at submit instead of holding a cluster for days or exhausting memory.
"""

from __future__ import annotations

import math
from typing import Any

from otray.types import ConfigError


class GT(float):
    """A strict lower bound: the value must be greater than it."""


_ENV = {  # one env's sampling and episode limits (envs.*) ...
    "num_rollouts": (1, 4096), "max_failing_rollouts": (0, None), "temperature": (0, None),
    "top_p": (GT(0), 1), "min_p": (0, 1), "weight": (0, None), "max_turns": (1, 100_000),
    "max_tokens_per_turn": (1, 1 << 20),
    "max_tokens_per_episode": (1, 1 << 22), "max_concurrency": (1, 4096), "timeout_s": (GT(0), None),
    "episode_timeout_s": (GT(0), None), "max_rollout_retries": (0, 100),
}
_GAME = {  # ... and a game's
    "num_rollouts": (1, 4096), "max_failing_rollouts": (0, None), "max_retries": (0, 100),
    "temperature": (0, None), "max_tokens_per_turn": (1, 1 << 20), "max_tokens_per_episode": (1, 1 << 22),
    "eval_games": (1, 1_000_000), "discount": (GT(0), 1), "opening_plies": (0, 100_000),
}

RANGES: dict[str, tuple[Any, Any]] = {
    "model.lora.rank": (0, None), "model.lora.alpha": (GT(0), None), "model.lora.dropout": (0, 1),
    "rollout.num_workers": (1, 1024), "rollout.max_model_len": (8, 1 << 20), "rollout.kv_cache_gb": (1, 4096),
    "rollout.max_batch": (1, 1 << 16),
    "resources.learner_cpus": (0, None), "resources.rollout_cpus": (0, None),
    "resources.learner_gpus": (0, None), "resources.rollout_gpus": (0, None),
    "resources.learner_threads": (1, None), "resources.rollout_threads": (1, None),
    "resources.learner_workers": (1, 1024), "resources.collective_timeout_s": (GT(0), None),
    "model.vision_lr_scale": (0, 1000), "algo.learning_rate": (0, None), "algo.kl_coeff": (0, 1000), "algo.lr_warmup_steps": (0, 1_000_000), "algo.weight_decay": (0, None), "algo.grad_clip": (0, None),
    "algo.grad_clip_relative": (0, 1000), "algo.vision_lr_scale": (0, 1000),
    "algo.steps": (0, 1_000_000), "algo.batch_size": (1, 1 << 16),
    "algo.micro_batch_tokens": (0, 1 << 24),  # 0: derived from the free GPU memory (8192 on the CPU)
    "rollout.gpu_memory_utilization": (GT(0), 1),
    "algo.max_steps_off_policy": (0, 1),  # 0: on-policy; 1: the next batch is sampled while the learner trains
    "eval.every": (0, None), "eval.num_samples": (1, 1_000_000),
    "sft.steps": (0, 1_000_000), "sft.batch_size": (1, 1 << 16), "sft.learning_rate": (0, None),
    "sft.warmup_steps": (0, None), "sft.stop_at_accuracy": (0, 1), "sft.check_every": (1, None),
    "sft.check_samples": (1, None), "sft.eval_samples": (1, None),
    "checkpoint.save_every": (0, None), "infer.limit": (1, None), "job.max_failures": (0, 100),
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
    "max_body_bytes": (1, None), "sample_batch_wait_ms": (0, None), "sample_call_max_samples": (1, None), "max_chunk_datums": (1, None),
    "max_samples": (1, None), "max_tokens": (1, None), "max_topk": (1, 100_000), "healing_replay_mb": (0, None),
    **{f"{where}.{k}": (0, None) for where in ("quota", "user_quotas.*")
       for k in ("training_clients", "lora_rank", "samplers", "concurrent_requests", "storage_gb")},
    "custom_losses.max_nodes": (1, 100_000), "custom_losses.max_graph_bytes": (1, None),
    "custom_losses.max_literal_numbers": (0, None), "custom_losses.max_losses": (0, None),
    "custom_losses.max_call_s": (GT(0), None),
    "scheduling.slice_tokens": (1, None), "scheduling.sample_turn_ms": (0, None), "scheduling.pass_tokens": (0, None), "scheduling.side_tokens": (0, None),
    "scheduling.coalesce_tokens": (0, None), "scheduling.follow_ms": (0, 10_000), "scheduling.calls_ahead": (1, 64),
    "scheduling.users.*.weight": (GT(0), 1e6), "scheduling.users.*.priority": (-1000, 1000),
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


def _num(x: float) -> str:
    """A bound as written: 1048576, not 1.04858e+06; 0.5 as 0.5."""
    return str(int(x)) if float(x).is_integer() else f"{float(x):g}"


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
                lo = "" if low is None else (f"> {_num(low)}" if strict else f">= {_num(low)}")
                hi = "" if high is None else f"<= {_num(high)}"
                raise ConfigError(f"{key} must be {' and '.join(x for x in (lo, hi) if x)}, got {value!r}")
