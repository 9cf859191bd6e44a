"""Sampling through oneDNN's prepacked linear kernels on CPU.

At decode time every linear layer multiplies a few rows (one per sequence) by its whole
weight matrix, so generation is bound by how fast the kernel streams weights. On this
project's 2-core AMD machine MKL's ``mm`` streams ~8 GB/s for an 8 x 768 x 2048 product;
oneDNN with the weight reordered into its blocked layout once does the same product in
~55% of the time (measured in session 8: ~100M model, 8 x 64 new tokens, HF generate
4.8-5.0 s plain vs 3.4-3.8 s packed, greedy tokens identical). vLLM's CPU backend repacks
its linear weights for the same reason.

``PackedLinears().active(model)`` swaps the forward of every float32 CPU ``nn.Linear``
for the packed kernel while sampling, inside inference mode only (the kernel has no
autograd), and restores it afterwards, so a learner that samples from its own model
(``rollout.colocate``) trains through the ordinary layers. Packed copies are rebuilt when
a weight may have changed: ``load_state_dict`` and ``copy_`` bump the tensor's ``_version``,
but a fused AdamW step does not (checked on torch 2.13), so whoever changes weights
otherwise calls ``invalidate()`` or passes ``weights_version``, a function whose value
changes with the weights (the colocated learner passes its policy version). PEFT's LoRA layers keep their own forward and call their
``base_layer``, which is an ordinary ``nn.Linear`` and is packed like any other.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

ROWS_HINT = 8  # oneDNN picks its blocking for this many rows; measured fine for 1-240 rows
# Smaller weights stay ordinary: on the tiny model (hidden 128) packing gained nothing
# (0.26-0.36 s either way for 256 x 8 tokens) and would be repacked after every step.
MIN_ELEMENTS = 1 << 18


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinears:
    def __init__(self, weights_version: Callable[[], Any] | None = None) -> None:
        self.weights_version = weights_version or (lambda: None)
        self.generation = 0
        self.packed: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[Any, ...], torch.Tensor]]" = \
            weakref.WeakKeyDictionary()

    def invalidate(self) -> None:
        """The weights changed in a way ``_version`` may not show: repack before the next use."""
        self.generation += 1

    def _packed_weight(self, layer: torch.nn.Linear, version: Any) -> torch.Tensor:
        key = (layer.weight.data_ptr(), layer.weight._version, self.generation, version)
        cached = self.packed.get(layer)
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                cached = (key, torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), ROWS_HINT))
            self.packed[layer] = cached
        return cached[1]

    @staticmethod
    def _layers(model: Any) -> list[torch.nn.Linear]:
        return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= MIN_ELEMENTS
                and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]

    @contextmanager
    def active(self, model: Any) -> Iterator[None]:
        """Inside: inference-mode calls of ``model``'s linear layers use packed weights."""
        if not available():
            yield
            return
        layers, version = self._layers(model), self.weights_version()
        for layer in layers:
            packed, ordinary = self._packed_weight(layer, version), layer.forward

            def forward(x: torch.Tensor, layer=layer, packed=packed, ordinary=ordinary) -> torch.Tensor:
                if not torch.is_inference_mode_enabled() or x.dtype != torch.float32:
                    return ordinary(x)
                return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")

            layer.forward = forward
        try:
            yield
        finally:
            for layer in layers:
                layer.__dict__.pop("forward", None)
