"""FixedRows: the routing of a bucketed pass (:mod:`otray.tinker.learner.pass_graphs`), one code path whatever its
adapters: each row's LoRA weights gathered from its layer's :class:`~otray.tinker.learner.lora_bank.LoraBank` by the
row's slot, so that a CUDA graph can replay it. :class:`~otray.tinker.learner.mixed_lora.RowRouting` sends a LoRA
layer's forward here while a pass is routed by one (:meth:`RowRouting.fixed_rows`).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class FixedRows:
    """A bucketed pass's routing, the same for every pass of its bucket (a CUDA graph replays it): row ``i`` goes
    through the adapter in bank slot ``slots[i]`` (``(rows,)`` long, refilled in place between passes); ``banks``:
    id(layer) -> that layer's bank of the pass's rank, ``(slots, r, in)`` and ``(slots, out, r)`` (layers not in it
    have none of the pass's adapters: base only). The update is scaled by ``scale`` (every row's) or, when None,
    row ``i``'s by ``scales[i]`` (``(rows, 1, 1)``, the activations' dtype). ``taken``: each layer's gathered rows
    of its banks, as the pass made them: the tensors whose gradients are each row's adapter's."""

    slots: torch.Tensor
    banks: dict[int, tuple[torch.Tensor, torch.Tensor]]
    scale: Optional[float] = None
    scales: Optional[torch.Tensor] = None
    taken: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def fixed_update(layer: Any, rows: FixedRows, result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``result`` (the base layer's) plus each row's update through its slot's weights, gathered from the bank; the
    gathered rows take the gradient (:attr:`FixedRows.taken`: per row, not scattered back into a bank-sized one)."""
    banks = rows.banks.get(id(layer))
    if banks is None:
        return result
    n = rows.slots.shape[0]
    with torch.no_grad():
        rows_a, rows_b = banks[0].index_select(0, rows.slots), banks[1].index_select(0, rows.slots)
    rows.taken.append((id(layer), rows_a.requires_grad_(True), rows_b.requires_grad_(True)))
    w_a, w_b = rows_a.to(x.dtype), rows_b.to(x.dtype)  # (rows, r, in), (rows, out, r)
    scale = rows.scales if rows.scales is not None else rows.scale
    return _RowUpdate.apply(result.reshape(n, -1, result.shape[-1]), x.reshape(n, -1, x.shape[-1]), w_a, w_b,
                            scale).view(result.shape)


class _RowUpdate(torch.autograd.Function):
    """``base + s (x A^T) B^T`` per row (``base``: (n, L, out), ``x``: (n, L, in), ``A``: (n, r, in), ``B``: (n, out, r);
    ``s``: a number, or ``(n, 1, 1)`` per row), every gradient contiguous in its tensor's own layout. (Left to
    autograd, B's gradient was the transpose of a contiguous (n, r, out): a first gradient of that layout made
    the CPU's fused AdamW, which walks a parameter and its gradient as flat memory alike, step the wrong
    elements.)"""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, xs: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor,
                scale: float | torch.Tensor) -> torch.Tensor:
        h = torch.bmm(xs, w_a.transpose(1, 2))  # (n, L, r)
        if isinstance(scale, torch.Tensor):
            h = h * scale
            out = torch.baddbmm(base, h, w_b.transpose(1, 2))
        else:
            out = torch.baddbmm(base, h, w_b.transpose(1, 2), alpha=scale)
        ctx.save_for_backward(xs, w_a, w_b, h)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        xs, w_a, w_b, h = ctx.saved_tensors  # h: already scaled when the scales are per row
        per_row = isinstance(ctx.scale, torch.Tensor)
        grad_b = torch.bmm(g.transpose(1, 2), h)  # (n, out, r)
        grad_h = torch.bmm(g, w_b)  # (n, L, r)
        if per_row:
            grad_h = grad_h * ctx.scale
        else:
            grad_b.mul_(ctx.scale)
            grad_h.mul_(ctx.scale)
        grad_a = torch.bmm(grad_h.transpose(1, 2), xs)  # (n, r, in)
        grad_x = torch.bmm(grad_h, w_a) if ctx.needs_input_grad[1] else None  # (n, L, in)
        return g, grad_x, grad_a, grad_b, None
