"""The names a config may choose for its algorithm, and each loss's config keys with defaults.

Kept below :mod:`otray.config` so that checking a config needs neither torch nor
:mod:`otray.algos`; the algorithms (``otray/algos/losses.py``, ``advantages.py``)
implement exactly these names and import them from here.
"""

from __future__ import annotations

from otray.types import ConfigError

LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
AGGREGATIONS = ("sum", "token_mean", "seq_mean_token_mean")
ADVANTAGE_NAMES = ("mean", "zscore", "rloo")
LOSS_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low": 0.8, "clip_high": 1.2},
    "cispo": {"clip_low": 0.0, "clip_high": 4.0},
    "dro": {"beta": 0.1},
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
