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

Sibling projections that read the same input (``q_proj``/``k_proj``/``v_proj`` of an
attention block, ``gate_proj``/``up_proj`` of an MLP: the Llama / Qwen / Mistral naming)
are packed as one concatenated weight: the first of them called computes all of their
outputs in one product and the others take their slice while the input is the same
tensor. Fewer, wider products stream the weights faster (measured in session 9: the
~100M model's linear layers 31 -> 25 ms per decode step). Where the names are missing,
or one of the siblings is not a plain float32 ``nn.Linear`` (a LoRA layer), the layers
are packed one by one.
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
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinears:
    def __init__(self, weights_version: Callable[[], Any] | None = None) -> None:
        self.weights_version = weights_version or (lambda: None)
        self.generation = 0
        self.packed: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[Any, ...], torch.Tensor]]" = \
            weakref.WeakKeyDictionary()
        self.fused: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[Any, ...], Any]]" = \
            weakref.WeakKeyDictionary()  # keyed on a group's first layer
        # per model: its modules (by id) when its plan was made, and the plan (a plan walks every module's
        # siblings by name: 1.5 ms a call on the tiny model, a streamed answer's turn is ~2 ms of decoding)
        self.plans: "weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], Any]]" = weakref.WeakKeyDictionary()

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

    def _packed_group(self, group: tuple[torch.nn.Linear, ...], version: Any) -> tuple[torch.Tensor, Any]:
        """The siblings' weights (and biases) concatenated along the output, packed; cached on the first."""
        key = tuple((m.weight.data_ptr(), m.weight._version) for m in group) + (self.generation, version)
        cached = self.fused.get(group[0])
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                weight = torch.cat([m.weight.detach() for m in group])
                bias = None if group[0].bias is None else torch.cat([m.bias.detach() for m in group])
                cached = (key, (torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), bias))
            self.fused[group[0]] = cached
        return cached[1]

    @staticmethod
    def _packable(m: Any) -> bool:
        return (type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
                and m.weight.dtype == torch.float32)

    @classmethod
    def _plan(cls, model: Any) -> tuple[list[torch.nn.Linear], list[tuple[torch.nn.Linear, ...]]]:
        """Layers to pack alone, and groups of siblings to pack together."""
        groups: list[tuple[torch.nn.Linear, ...]] = []
        for parent in model.modules():
            for names in FUSED_SIBLINGS:
                members = tuple(getattr(parent, n, None) for n in names)
                if (all(cls._packable(m) for m in members)
                        and len({(m.in_features, m.bias is None) for m in members}) == 1
                        and sum(m.weight.numel() for m in members) >= MIN_ELEMENTS):
                    groups.append(members)
        grouped = {id(m) for g in groups for m in g}
        alone = [m for m in model.modules() if cls._packable(m) and id(m) not in grouped
                 and m.weight.numel() >= MIN_ELEMENTS]
        return alone, groups

    @contextmanager
    def active(self, model: Any) -> Iterator[None]:
        """Inside: inference-mode calls of ``model``'s linear layers use packed weights."""
        if not available():
            yield
            return
        modules = tuple(map(id, model.modules()))  # a module swapped in (a LoRA layer) or out: plan again
        kept = self.plans.get(model)
        if kept is None or kept[0] != modules:
            kept = self.plans[model] = (modules, self._plan(model))
        alone, groups = kept[1]
        version = self.weights_version()
        for layer in alone:
            packed, ordinary = self._packed_weight(layer, version), layer.forward

            def forward(x: torch.Tensor, layer=layer, packed=packed, ordinary=ordinary) -> torch.Tensor:
                if not torch.is_inference_mode_enabled() or x.dtype != torch.float32:
                    return ordinary(x)
                return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")

            layer.forward = forward
        for group in groups:
            weight, bias = self._packed_group(group, version)
            sizes = [m.out_features for m in group]
            last: dict[str, Any] = {"x": None, "outs": ()}  # the group's latest input and its outputs

            for i, layer in enumerate(group):
                def forward(x: torch.Tensor, i=i, ordinary=layer.forward, weight=weight, bias=bias, sizes=sizes,
                            last=last) -> torch.Tensor:
                    if not torch.is_inference_mode_enabled() or x.dtype != torch.float32:
                        return ordinary(x)
                    if last["x"] is not x:
                        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
                        last["x"], last["outs"] = x, y.split(sizes, dim=-1)
                    return last["outs"][i].contiguous()

                layer.forward = forward
        layers = alone + [m for g in groups for m in g]
        try:
            yield
        finally:
            for layer in layers:
                layer.__dict__.pop("forward", None)
