"""The policy RL started from, kept beside the trained one: ``algo.kl_coeff``'s reference. Runs in the learner actor.

An :class:`Anchor` holds a frozen copy of the model's trainable tensors (every weight of a full model,
the adapter of a LoRA one) as they were when RL began (after the SFT warm-up). :meth:`Anchor.logprobs`
scores a micro-batch under those weights by swapping the tensors' storage in and out (no copies), in
no-grad mode and *before* the micro-batch's own forward with gradients, so that no autograd graph ever
holds the swapped storage. :func:`kl_to_anchor` is the per-token k3 estimate of KL(policy || anchor),
``exp(ref - lp) - (ref - lp) - 1``: non-negative, zero where the two agree, its gradient pulling each
sampled token's logprob back towards the anchor's. It is saved with the learner's checkpoint
(``state/anchor.pt``), so a resumed or healed job keeps the same reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from otray.actors.learner.core import token_logprobs
from otray.types import Datum

FILE = "anchor.pt"


class Anchor:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors  # parameter name -> its frozen value

    @classmethod
    def of(cls, model: torch.nn.Module) -> Anchor:
        """The model's trainable tensors as they are now."""
        return cls({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, batch: Sequence[Datum], device: str, autocast: Any) -> torch.Tensor:
        """Target-token logprobs of ``batch`` under the anchor's weights (``[rows, width]``, padded as
        :func:`~otray.actors.learner.core.token_logprobs` pads); the model's own weights are back after."""
        params = dict(model.named_parameters())
        live = {n: params[n].data for n in self.tensors}
        was_training = model.training
        model.eval()  # (dropout off: the reference is the policy, not a noisy sample of it)
        try:
            for n, t in self.tensors.items():
                params[n].data = t
            with autocast:
                ref, _ = token_logprobs(model, list(batch), device)
        finally:
            for n, t in live.items():
                params[n].data = t
            model.train(was_training)
        return ref

    def save(self, out: Path) -> None:
        torch.save(self.tensors, out / FILE)

    @classmethod
    def load(cls, src: Path, device: str) -> Anchor | None:
        """The anchor a checkpoint saved, on ``device``; None when it saved none."""
        path = src / FILE
        return cls(torch.load(path, weights_only=True, map_location=device)) if path.exists() else None


K3_CAP = 10.0  # the largest per-token k3 that carries a gradient (verl's low_var_kl caps it the same way)


def kl_to_anchor(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || anchor) at the sampled tokens (``lp`` carries the gradient),
    capped at :data:`K3_CAP`. The estimate's gradient is ``1 - exp(ref - lp)``: a sampled token the policy
    has made e^d times rarer than the anchor did pulls e^d times harder than usual. Unbiased over many
    samples, but a batch samples such a token rarely, and then its one pull outweighs the rest of the
    step (grad_clip scales the whole step down to it). Past the cap (d > ~2.6) a token pulls no more."""
    d = ref.detach() - lp
    return (torch.exp(d) - d - 1).clamp(max=K3_CAP)
