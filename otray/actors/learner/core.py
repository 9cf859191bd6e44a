"""The learner core: what every learner does the same way, whatever holds the model.

PolicyLearner, the ranks of a sharded LearnerGroup and the Tinker service's AdapterLearner all
import these, so one call's datums are cut, padded, scored and stepped alike everywhere:

- :func:`plan_micro_batches` (shortest first, cut at a token budget and at ``PAD_SPREAD``) and
  :func:`in_order` (a call's rows back in the datums' order);
- :func:`pad_rows`, :func:`token_logprobs` (a micro-batch's per-target-token logprobs) and
  :func:`loss_inputs` (its mask, sampler logprobs, advantages and weights as tensors);
- :func:`global_normalizer` (what a whole call's aggregation divides by), :func:`batch_stats` (a
  micro-batch's loss statistics, kept on the device) and :class:`LossSums` (their sums, copied to the
  host once per call: the metrics);
- :func:`trainable`, :func:`new_adamw` and :func:`adamw_step` (clip, step, zero the gradients), with
  :func:`scale_learning_rate` for parameters trained slower (a VLM's vision tower: ``model.vision_lr_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from otray.names import loss_config
from otray.types import Datum, LossNormalizer
from otray.vlm import NEVER, unsampled_ids


def micro_batches(datums: Sequence[Datum], token_budget: int, max_spread: float | None = None) -> list[list[Datum]]:
    """Consecutive chunks whose padded size (rows x longest row) stays within budget; with
    ``max_spread``, a chunk also ends before a row longer than ``max_spread`` x its shortest row
    (on datums sorted by length, :func:`by_length`, short rows then share a chunk of their own
    instead of being padded to the long ones)."""
    chunks: list[list[Datum]] = []
    current: list[Datum] = []
    longest, shortest = 0, 0
    for d in datums:
        new_longest = max(longest, len(d))
        spread = max_spread is not None and current and new_longest > max_spread * min(shortest, len(d))
        if current and (new_longest * (len(current) + 1) > token_budget or spread):
            chunks.append(current)
            current, new_longest = [], len(d)
        shortest = len(d) if not current else min(shortest, len(d))
        current.append(d)
        longest = new_longest
    if current:
        chunks.append(current)
    return chunks


# A micro-batch's longest row at most this many times its shortest (rows sorted by length). Measured
# here (tiny model, 2 cores): a batch of 16 ~12-token and 16 ~200-token rows, the OpenReward SFT
# warm-up's mix, took 0.78 s a forward_backward as one padded micro-batch and 0.40 s as two.
PAD_SPREAD = 2.0


def by_length(datums: Sequence[Datum]) -> list[int]:
    """Indices of ``datums`` shortest first (stable): micro-batches cut from this order pad short rows
    to their own length, not to the longest of the call's. The loss is a sum over tokens divided by
    the whole call's normalizer, so the order changes nothing but float rounding."""
    return sorted(range(len(datums)), key=lambda i: len(datums[i]))


def plan_micro_batches(datums: Sequence[Datum], token_budget: int) -> tuple[list[list[Datum]], list[int]]:
    """How a learner cuts one call's datums: shortest first, at the budget and at ``PAD_SPREAD``;
    returns the micro-batches and the datum order they hold (``order[k]``: the k-th row's index).
    A call that fits one micro-batch keeps its own order, so its sums are added as they always were
    (the demo's runs are reproducible across this change)."""
    order = by_length(datums)
    batches = micro_batches([datums[i] for i in order], token_budget, PAD_SPREAD)
    if len(batches) == 1:
        return [list(datums)], list(range(len(datums)))
    return batches, order


def in_order(rows: list[list[float]], order: list[int]) -> list[list[float]]:
    """``rows`` (the k-th for datum ``order[k]``) back in the datums' own order."""
    out: list[list[float]] = [[] for _ in rows]
    for k, i in enumerate(order):
        out[i] = rows[k]
    return out


def pad_rows(rows: list[list[float]] | list[list[int]], width: int, value: float, dtype: torch.dtype,
             device: str = "cpu") -> torch.Tensor:
    """``rows`` as one ``(len(rows), width)`` tensor, right-padded with ``value``, on ``device``."""
    # padded in Python and made in one call: 4x faster than a tensor per row copied into a filled one (8 rows of
    # 19: 14 against 61 us; a one-datum user's rows pass here ~10 times a step)
    if not rows:
        return torch.empty((0, width), dtype=dtype, device=device)
    longest = max(map(len, rows))
    if longest > width:
        raise ValueError(f"a row of {longest} values does not fit a width of {width}")
    out = torch.tensor([[*r, *[value] * (width - len(r))] for r in rows], dtype=dtype)
    return out if device == "cpu" else out.to(device, non_blocking=True)


def global_normalizer(datums: Sequence[Datum], normalizer: LossNormalizer | None) -> LossNormalizer:
    """What the whole batch's aggregation divides by: ``datums``' own masked tokens and sequences, or
    ``normalizer``'s where larger (datums left out of the call still count)."""
    tokens = float(sum(sum(d.mask) for d in datums))
    return LossNormalizer(max(tokens, normalizer.tokens if normalizer else 0.0),
                          max(float(len(datums)), normalizer.sequences if normalizer else 0.0))


@dataclass
class LossSums:
    """Sums over one ``forward_backward`` call's masked tokens, from which its metrics are made; the
    ranks of a sharded learner each return theirs and the group adds them up (:meth:`plus`)."""

    loss: float = 0.0
    tokens: float = 0.0
    sequences: float = 0.0
    ratio: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0
    absdiff: float = 0.0
    absdiff_max: float = 0.0  # the largest |sampler - learner| logprob gap of one token
    nll: float = 0.0  # -(sampler logprob) of the sampled tokens: the sampling entropy's estimate, summed
    kl_start: float = 0.0  # KL(policy || the policy RL started from), k3 per token, summed (algo.kl_coeff)
    compute_s: float = 0.0

    @classmethod
    def of(cls, stats: list[torch.Tensor], tokens: float, sequences: float) -> LossSums:
        """The sums of :func:`batch_stats` rows (one per micro-batch, on the device): one host copy."""
        if not stats:
            return cls(tokens=tokens, sequences=sequences)
        rows = torch.stack(stats).double().cpu()
        loss, ratio, clipped, kl, absdiff = rows[:, :5].sum(0).tolist()
        return cls(loss, tokens, sequences, ratio, clipped, kl, absdiff, float(rows[:, 5].max()), float(rows[:, 6].sum()),
                   float(rows[:, 7].sum()))

    def plus(self, other: LossSums) -> LossSums:
        """Both calls' sums; ``compute_s`` and ``absdiff_max`` are the larger one's (ranks run side by side)."""
        larger = ("compute_s", "absdiff_max")
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name not in larger}
        return LossSums(**summed, **{k: max(getattr(self, k), getattr(other, k)) for k in larger})

    def metrics(self, loss_fn: str) -> dict[str, float]:
        if not self.sequences:
            return {"loss": 0.0, "num_tokens": 0.0, "num_sequences": 0.0}
        n = max(self.tokens, 1.0)
        out = {"loss": self.loss, "num_tokens": self.tokens, "num_sequences": self.sequences,
               "compute_s": self.compute_s}
        if loss_fn != "cross_entropy":
            out.update({"ratio_mean": self.ratio / n, "clip_frac": self.clipped / n, "approx_kl": self.kl / n,
                        "logprob_diff_mean": self.absdiff / n, "logprob_diff_max": self.absdiff_max,
                        "entropy": self.nll / n})
        if self.kl_start:
            out["kl_to_start"] = self.kl_start / n
        return out


def batch_stats(loss: torch.Tensor, lp: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, loss_fn: str,
                cfg: dict[str, float], kl_start: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batch's ``[loss, ratio sum, clipped tokens, KL sum, |diff| sum, |diff| max, -q sum, KL-to-start
    sum]`` over its masked tokens (``-q``: the sampled tokens' surprise, whose mean estimates the sampling
    entropy; ``kl_start``: per-token KL to the anchor, :mod:`otray.actors.learner.anchor`), as one tensor on the device (no host sync: :meth:`LossSums.of` copies them once)."""
    with torch.no_grad():
        ratio = torch.exp(lp - q)
        full = loss_config(loss_fn, **cfg)
        if "clip_high" in full:
            lo, hi = full.get("clip_low", 0.0), full["clip_high"]
            clipped = (((ratio < lo) | (ratio > hi)).float() * mask).sum()
        else:
            clipped = torch.zeros((), device=lp.device)
        gap = (q - lp) * mask
        return torch.stack([loss.detach().float(), (ratio * mask).sum(), clipped, gap.sum(), gap.abs().sum(),
                            gap.abs().max(), -(q * mask).sum(),
                            (kl_start.detach() * mask).sum() if kl_start is not None else gap.new_zeros(())])


LR_SCALE = "otray_lr_scale"  # a parameter's attribute: its learning rate is this times the step's (default 1)
VISION = "otray_vision"  # a parameter's attribute: part of a VLM's vision tower (its own optimizer group)


def scale_learning_rate(params: Sequence[torch.nn.Parameter], scale: float, vision: bool = False) -> None:
    """Train ``params`` at ``scale`` times the learning rate of each step (:func:`new_adamw` groups them;
    ``vision``: a vision tower's, whose rate an RL step may set apart, :func:`adamw_step`)."""
    for p in params:
        setattr(p, LR_SCALE, float(scale))
        if vision:
            setattr(p, VISION, True)


def new_adamw(params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where the parameters allow it (float tensors on CPU or CUDA),
    else the default implementation. Measured here (2 cores, ~100M float32 parameters): fused
    0.07-0.08 s a step, the default (per-parameter loop on CPU) 0.2-0.8 s. Parameters given a learning-rate
    scale (:func:`scale_learning_rate`) form their own group, in order of first appearance."""
    by_scale: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for p in params:
        by_scale.setdefault((getattr(p, LR_SCALE, 1.0), getattr(p, VISION, False)), []).append(p)
    if len(by_scale) > 1:
        params = [{"params": ps, "lr_scale": scale} for (scale, _), ps in by_scale.items()]  # type: ignore[misc]
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kwargs)


def _logits(model: torch.nn.Module, batch: Sequence[Datum], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, valid)``: the model's fp32 logits over ``batch``'s right-padded inputs, and a float
    mask of the positions that hold a token."""
    width = max(len(d) for d in batch)
    ids = pad_rows([d.input_ids for d in batch], width, 0, torch.long, device)
    attn = pad_rows([[1] * len(d) for d in batch], width, 0, torch.long, device)
    logits = model(input_ids=ids, attention_mask=attn, **image_kwargs(model, batch, ids)).logits
    return sampled_logits(model, logits), attn.float()


def sampled_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (the model's) in fp32, the tokens a policy never samples masked (a vision-language policy's
    vision tokens: :mod:`otray.vlm`)."""
    logits = logits.float()
    off = unsampled_ids(model.config)
    if off:
        logits = logits.index_fill(-1, torch.tensor(off, device=logits.device), NEVER)
    return logits


def image_kwargs(model: torch.nn.Module, batch: Sequence[Datum], ids: torch.Tensor) -> dict[str, Any]:
    """What a vision-language model takes for ``batch``'s images beside ``ids`` (none without images;
    an image sent to a text-only model, or image tokens that do not match the images, is an ImageError)."""
    if not any(d.images for d in batch):
        return {}
    from otray.vlm import vision_inputs

    vision = vision_inputs(model)
    for d in batch:
        vision.check_tokens(d.input_ids, d.images)
    return vision.model_kwargs(ids, [d.images for d in batch])


def token_logprobs(model: torch.nn.Module, batch: Sequence[Datum], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, valid)``: each row's logprob of its target tokens under ``model`` (fp32,
    ``(rows, longest row)``) and a float mask of the positions that hold a token."""
    logits, valid = _logits(model, batch, device)
    return targets_logprobs(logits, batch, device), valid


def targets_logprobs(logits: torch.Tensor, batch: Sequence[Datum], device: str = "cpu") -> torch.Tensor:
    """Each row's logprobs of its targets from fp32 ``logits`` (``(rows, T, vocab)``): ``(rows, T)``, or
    ``(rows, T, K)`` for top-K datums (``Datum.target_k``; padded positions read token 0)."""
    if batch[0].target_k is not None:
        targets = torch.zeros(*logits.shape[:2], len(batch[0].target_k[0]), dtype=torch.long)
        for i, d in enumerate(batch):
            targets[i, :len(d)] = torch.tensor(d.target_k, dtype=torch.long)
        return torch.log_softmax(logits, -1).gather(-1, targets.to(device))
    targets = pad_rows([d.target_ids for d in batch], logits.shape[1], 0, torch.long, device)
    return -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def position_log_softmax(model: torch.nn.Module, datum: Datum, device: str = "cpu") -> torch.Tensor:
    """One datum's next-token distributions: the log-softmax over the vocabulary at each of its
    positions, ``(len(datum), vocab)`` fp32 (vision tokens masked as in :func:`token_logprobs`)."""
    logits, _ = _logits(model, [datum], device)
    return torch.log_softmax(logits[0, :len(datum)], -1)


def topk_logprobs(model: torch.nn.Module, batch: Sequence[Datum], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, valid)`` as :func:`token_logprobs`, for each row's K targets per position
    (``Datum.target_k``): ``(rows, longest row, K)``; padded positions read token 0."""
    logits, valid = _logits(model, batch, device)
    return targets_logprobs(logits, batch, device), valid


def topk_weights(batch: Sequence[Datum], width: int, device: str = "cpu") -> torch.Tensor:
    """The ``(rows, width, K)`` weights of :func:`topk_logprobs`' targets (0 on padding)."""
    out = torch.zeros(len(batch), width, len(batch[0].weights_k[0]), dtype=torch.float32)
    for i, d in enumerate(batch):
        out[i, :len(d)] = torch.tensor(d.weights_k, dtype=torch.float32)
    return out if device == "cpu" else out.to(device, non_blocking=True)


@dataclass
class LossInputs:
    """A micro-batch's loss inputs as padded tensors: what ``per_token_loss`` takes beside the logprobs."""

    mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor | None
    ratio_mask: torch.Tensor  # the tokens of gspo's / stable_reinforce's ratio (a datum's own mask by default)
    clip_tokens: tuple[torch.Tensor | None, torch.Tensor | None]  # per-token thresholds, NaN: the config's

    def extras(self) -> dict[str, Any]:
        """The keyword arguments of ``per_token_loss`` besides the tensors it takes by position."""
        return {"ratio_mask": self.ratio_mask, "clip_tokens": self.clip_tokens}


def loss_inputs(batch: Sequence[Datum], width: int, device: str = "cpu", *, every_token: bool = False) -> LossInputs:
    """The padded loss inputs of ``batch``; ``every_token``: a mask of every token (the Tinker API's
    losses weight tokens themselves) instead of the datums' own masks."""
    f32 = torch.float32

    def rows(get: Any, fill: float) -> torch.Tensor | None:
        """One optional per-token field of every datum, padded; rows without it hold ``fill``."""
        if all(get(d) is None for d in batch):
            return None
        return pad_rows([get(d) if get(d) is not None else [fill] * len(d) for d in batch], width, fill, f32, device)

    masks = [[1.0] * len(d) for d in batch] if every_token else [d.mask for d in batch]
    weights = None if batch[0].weights is None else pad_rows([d.weights or [] for d in batch], width, 0.0, f32, device)
    ratio_mask = pad_rows([d.ratio_mask if d.ratio_mask is not None else d.mask for d in batch], width, 0.0, f32, device)
    nan = float("nan")
    return LossInputs(pad_rows(masks, width, 0.0, f32, device),
                      pad_rows([d.sampler_logprobs for d in batch], width, 0.0, f32, device),
                      pad_rows([d.advantages for d in batch], width, 0.0, f32, device), weights, ratio_mask,
                      (rows(lambda d: d.clip_low, nan), rows(lambda d: d.clip_high, nan)))


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that take gradients (a LoRA model's adapters; every one of a full model)."""
    return [p for p in model.parameters() if p.requires_grad]


def grad_norm(params: Sequence[torch.nn.Parameter]) -> float:
    """The 2-norm of these parameters' accumulated gradients (0 when none has one); over every shard of a
    sharded model (a collective then: every rank calls it)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])  # (clip_grad_norm_'s)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor's: its partial norms summed


def adamw_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], *, learning_rate: float,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               grad_clip: float | None = 1.0, vision_lr_scale: float | None = None) -> float:
    """One AdamW step on the accumulated gradients of ``params`` with these settings, the gradient
    norm clipped to ``grad_clip`` (None or 0: not clipped); zeroes the gradients. ``vision_lr_scale``: the
    vision tower's group (its parameters marked :data:`VISION`, so a group loaded from an older checkpoint is known
    too) at this times ``learning_rate`` instead of its own scale (an RL step's ``algo.vision_lr_scale``; 0: not
    moved, its gradient still in the norm). Returns the gradient norm before clipping."""
    for group in optimizer.param_groups:
        vision = vision_lr_scale is not None and bool(group["params"]) and getattr(group["params"][0], VISION, False)
        scale = vision_lr_scale if vision else group.get("lr_scale", 1.0)
        group.update(lr=learning_rate * scale, betas=tuple(betas), eps=eps,
                     weight_decay=weight_decay)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip else float("inf"), foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
