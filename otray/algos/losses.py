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
gspo                          ``-min(s*A, clip(s, clip_low, clip_high)*A)``
stable_reinforce              ``m * (-sg(min(r, clip_high)) * A * lp``
                              ``+ kl_coeff * (r - 1 - log r))``
============================  ================================================

Defaults: ppo and gspo clip the ratio to [0.8, 1.2]; cispo to [0.0, 4.0]; dro beta = 0.1;
stable_reinforce caps the weight at 2.0 with no KL term.

gspo (GSPO-token, Zheng et al. 2025, as the Tinker docs define it): ``s`` is the *sequence* ratio,
the geometric mean of ``r`` over the tokens ``m`` of ``ratio_mask`` (a row's sampled tokens),
carried by every token with the gradient of that token's own logprob:
``s = exp(mean_m(sg(lp) - q) + lp - sg(lp))``. Clipping ``s`` keeps or drops whole sequences.

stable_reinforce is otray's reading of Tinker's alpha loss of that name, whose exact objective
Tinker does not publish: REINFORCE with a truncated importance weight (the ratio to the sampler's
*recorded* logprobs, detached and capped at ``clip_high``) plus an optional ``kl_coeff`` times the
k3 estimate of KL(sampler || learner), over the tokens ``m`` the sampler recorded (``ratio_mask``;
other positions contribute nothing). Its gradient is ``-min(r, cap) * A`` per token: bounded
however far off-policy the data is, and equal to ``importance_sampling``'s while ``r <= cap``.

Per-token clip thresholds (``clip_tokens``: two tensors, NaN where the config's value applies)
override ``clip_low`` / ``clip_high`` token by token.

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
    *,
    ratio_mask: torch.Tensor | None = None,
    clip_tokens: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    **loss_fn_config: float,
) -> torch.Tensor:
    """Per-token loss of shape ``logprobs.shape``, before masking and aggregation. ``ratio_mask``:
    gspo's and stable_reinforce's tokens (each row's sampled tokens; every token when None);
    ``clip_tokens``: per-token ``(low, high)`` thresholds, NaN (or None) where the config's apply."""
    cfg = loss_config(name, **loss_fn_config)
    lp, q, adv = logprobs, sampler_logprobs.detach(), advantages.detach()
    if name == "cross_entropy":
        w = torch.ones_like(lp) if weights is None else weights.detach()
        return -w * lp
    if name == "dro":
        return -(adv * lp - cfg["beta"] / 2 * (lp - q) ** 2)
    m = torch.ones_like(lp) if ratio_mask is None else ratio_mask.detach()
    if name == "gspo":
        seq = ((lp.detach() - q) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(seq + lp - lp.detach())
    else:
        ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -ratio * adv
    lo, hi = _thresholds(lp, cfg, clip_tokens)
    if name in ("ppo", "gspo"):
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    if name == "cispo":
        return -torch.clamp(ratio, lo, hi).detach() * adv * lp
    # stable_reinforce
    weight = torch.minimum(ratio, hi).detach()
    k3 = ratio - 1 - (lp - q)
    return m * (-weight * adv * lp + cfg["kl_coeff"] * k3)


def _thresholds(like: torch.Tensor, cfg: dict[str, float],
                clip_tokens: tuple[torch.Tensor | None, torch.Tensor | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip range per token: ``clip_tokens``' values where given (not NaN), else the config's."""
    out = []
    for i, key in enumerate(("clip_low", "clip_high")):
        default = torch.full_like(like, cfg.get(key, 0.0 if key == "clip_low" else float("inf")))
        given = clip_tokens[i] if clip_tokens is not None else None
        out.append(default if given is None else torch.where(torch.isnan(given), default, given.to(like.dtype)))
    return out[0].detach(), out[1].detach()


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
