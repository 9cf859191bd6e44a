"""Several LoRA adapters in one pass: each row of a batch goes through its own adapter.

PEFT runs one active adapter at a time in training (its ``adapter_names`` routing refuses a model in
train mode), so ten users' one-datum steps used to be ten passes over the base model, each bound by
kernel launches rather than tokens. :class:`RowRouting` replaces the forward of every LoRA layer once
with one that, while a pass is *routed* (:meth:`RowRouting.routed`), computes the base layer on the
whole batch and adds each adapter's low-rank update to its own rows only: rows are grouped by adapter
(contiguous), one pair of matmuls per adapter and layer, whatever its rank. Outside a routed pass the
layer is PEFT's own (sampling, the single-adapter reference path).

The adapter's update is computed in the activations' dtype from the adapter's float32 master weights
(cast once per layer and pass: a rank-r matrix, not the activations); on a bf16 base this skips PEFT's
cast of every LoRA input to float32 and back. Gradients reach each adapter from its rows only, so an
adapter trained in mixed passes equals one trained alone (tests/tinker/test_mixed_passes.py).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

Group = tuple[str, int, int]  # (adapter, first row, row after the last)


def groups_of(adapters: Sequence[str]) -> list[Group]:
    """Runs of equal adapters in row order: ``["a", "a", "b"]`` -> ``[("a", 0, 2), ("b", 2, 3)]``."""
    out: list[Group] = []
    for i, name in enumerate(adapters):
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1], i + 1)
        else:
            out.append((name, i, i + 1))
    return out


class RowRouting:
    """Which adapter each row of the current pass uses; read by every LoRA layer it was installed on."""

    def __init__(self) -> None:
        self.groups: Optional[list[Group]] = None
        self.rows = 0
        self._installed: Optional[list[Any]] = None

    def install(self, layers: list[Any]) -> None:
        """Give each LoRA layer in ``layers`` the routed forward (once per layer; a set of layers changes
        when adapters with other target modules are added)."""
        if self._installed is layers:
            return
        for m in layers:
            if getattr(m, "_otray_routing", None) is not self and hasattr(m, "lora_A"):
                m.forward = functools.partial(_forward, m, self, type(m).forward.__get__(m))
                m._otray_routing = self
        self._installed = layers

    @contextmanager
    def routed(self, groups: list[Group]) -> Iterator[None]:
        """Route the passes inside to ``groups`` (which must cover the batch's rows in order)."""
        self.groups, self.rows = groups, groups[-1][2] if groups else 0
        try:
            yield
        finally:
            self.groups, self.rows = None, 0


def _forward(layer: Any, routing: RowRouting, original: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:
    groups = routing.groups
    if groups is None:
        return original(x, *args, **kwargs)
    if layer.merged:
        raise RuntimeError("a routed pass over merged LoRA weights (unmerge first)")
    if x.shape[0] != routing.rows:
        raise RuntimeError(f"routed LoRA layer got {x.shape[0]} rows for a pass of {routing.rows}: this layer does "
                           "not see the batch's rows (a vision tower?); run such requests alone")
    result = layer.base_layer(x, *args, **kwargs)
    parts = []
    for name, start, stop in groups:
        a = layer.lora_A[name] if name in layer.lora_A else None
        if a is None:
            parts.append(result.new_zeros((stop - start, *result.shape[1:])))
            continue
        w_a, w_b = a.weight.to(x.dtype), layer.lora_B[name].weight.to(x.dtype)
        parts.append(F.linear(F.linear(x[start:stop], w_a), w_b) * layer.scaling[name])
    return result + (parts[0] if len(parts) == 1 else torch.cat(parts)).to(result.dtype)
