"""The names a config may choose for its algorithm, each loss's config keys with defaults, and the
shape of a checkpoint reference (``JOB_ID[:STEP]``).

Kept below :mod:`otray.config` so that checking a config needs neither torch nor
:mod:`otray.algos`; the algorithms (``otray/algos/losses.py``, ``advantages.py``)
implement exactly these names and import them from here.
"""

from __future__ import annotations

import re

from otray.types import ConfigError

_JOB_REF = re.compile(r"(?P<job>\d{8}-\d{6}-[0-9a-f]{6})(?::(?P<step>\d+))?")


def parse_ref(ref: str) -> tuple[str, int | None] | None:
    """``JOB_ID[:STEP]`` (a checkpoint registered with the ResourceManager) -> (job id, step or None);
    anything else (a path) -> None."""
    m = _JOB_REF.fullmatch(ref.strip())
    if m is None:
        return None
    return m["job"], int(m["step"]) if m["step"] is not None else None

LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
AGGREGATIONS = ("sum", "token_mean", "seq_mean_token_mean")
ADVANTAGE_NAMES = ("mean", "zscore", "rloo")
LOSS_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low": 0.8, "clip_high": 1.2},
    "cispo": {"clip_low": 0.0, "clip_high": 4.0},
    "dro": {"beta": 0.1},
    "gspo": {"clip_low": 0.8, "clip_high": 1.2},
    "stable_reinforce": {"clip_high": 2.0, "kl_coeff": 0.0},
}


def loss_config(name: str, **overrides: float) -> dict[str, float]:
    """The full config of loss ``name``: its defaults updated with ``overrides``."""
    if name not in LOSS_DEFAULTS:
        raise ConfigError(f"unknown loss_fn {name!r}; choose one of {', '.join(LOSS_NAMES)}")
    unknown = set(overrides) - set(LOSS_DEFAULTS[name])
    if unknown:
        valid = ", ".join(LOSS_DEFAULTS[name]) or "none"
        raise ConfigError(f"loss_fn {name!r} takes no config key(s) {sorted(unknown)}; valid keys: {valid}")
    return {**LOSS_DEFAULTS[name], **overrides}
