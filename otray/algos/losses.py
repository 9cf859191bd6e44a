"""Policy-gradient and supervised losses, per token, then aggregated.

Notation, per target token t: ``lp`` learner logprob (carries the gradient), ``q``
sampler logprob, ``A`` advantage, ``r = exp(lp - q)``, ``sg`` stop-gradient.

============================  ================================================
name                          per-token loss
============================  ================================================
cross_entropy                 ``-w * lp``
importance_sampling           ``-r * A``
ppo                           ``-min(r*A, clip(r, clip_low, clip_high)*A)``
cispo                         ``-sg(clip(r, clip_low, clip_high)) * A * lp``
dro                           ``-(A*lp - beta/2 * (lp - q)**2)``
============================  ================================================

Defaults: ppo clips the ratio to [0.8, 1.2]; cispo to [0.0, 4.0]; dro beta = 0.1.

Aggregation (``aggregate``) turns masked per-token losses into one scalar:

- ``sum``: sum over all masked tokens.
- ``token_mean``: that sum divided by the number of masked tokens in the *whole
  batch* (every token weighs the same; long answers weigh more).
- ``seq_mean_token_mean``: mean over each sequence's masked tokens, then mean over
  sequences (every sequence weighs the same).

Normalizers are passed in explicitly so that a batch split into micro-batches gives
the same gradient as the unsplit batch.
"""

from __future__ import annotations

import torch

from otray.names import AGGREGATIONS, LOSS_NAMES, loss_config  # noqa: F401 (LOSS_NAMES re-exported)
from otray.types import ConfigError


def per_token_loss(
    name: str,
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | None = None,
    **loss_fn_config: float,
) -> torch.Tensor:
    """Per-token loss of shape ``logprobs.shape``, before masking and aggregation."""
    cfg = loss_config(name, **loss_fn_config)
    lp, q, adv = logprobs, sampler_logprobs.detach(), advantages.detach()
    if name == "cross_entropy":
        w = torch.ones_like(lp) if weights is None else weights.detach()
        return -w * lp
    ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -ratio * adv
    if name == "ppo":
        clipped = torch.clamp(ratio, cfg["clip_low"], cfg["clip_high"])
        return -torch.minimum(ratio * adv, clipped * adv)
    if name == "cispo":
        clipped = torch.clamp(ratio, cfg["clip_low"], cfg["clip_high"]).detach()
        return -clipped * adv * lp
    # dro
    return -(adv * lp - cfg["beta"] / 2 * (lp - q) ** 2)


def aggregate(
    losses: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
) -> torch.Tensor:
    """Aggregate ``[batch, time]`` per-token losses over ``mask``.

    ``total_tokens`` / ``total_sequences`` are the normalizers of the whole batch
    when ``losses`` is one micro-batch of it; they default to this tensor's own.
    """
    if mode not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")
    masked = losses * mask
    if mode == "sum":
        return masked.sum()
    if mode == "token_mean":
        denom = total_tokens if total_tokens is not None else mask.sum().item()
        return masked.sum() / max(denom, 1.0)
    per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    denom = total_sequences if total_sequences is not None else float(losses.shape[0])
    return per_seq.sum() / max(denom, 1.0)
