"""Switching the active LoRA adapter of a PEFT model with many adapters, cheaply.

The :class:`~otray.tinker.learner.adapter_learner.AdapterLearner` switches adapters on almost every call once users
share it (the fair queue, :mod:`otray.tinker.learner.fair`, interleaves their calls). PEFT's
``set_adapter`` walks every module and every adapter's parameters: 18 ms a call with 11 adapters
on the tiny model, more than a one-datum forward_backward, and growing with each client. This does
the same switch on the LoRA layers found once per set of adapters, and keeps each adapter's
parameter list, so a switch costs microseconds and an optimizer step no longer walks the model.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch


class AdapterSwitch:
    """Which adapter a PEFT model's LoRA layers use. Call :meth:`changed` after adding or deleting one."""

    def __init__(self) -> None:
        self.active: Optional[str] = None  # None: unknown (switch on the next use)
        self.layers: Optional[list[Any]] = None  # the LoRA layers, found once per set of adapters
        self.lists: dict[str, list[torch.nn.Parameter]] = {}  # adapter -> its LoRA parameters

    def changed(self) -> None:
        self.active, self.layers = None, None
        self.lists.clear()

    def use(self, model: Any, adapter: str) -> None:
        """Make ``adapter`` the only active adapter of ``model`` (a PeftModel), its parameters trainable.
        The other adapters' ``requires_grad`` flags stay as they are: they take no part in the pass, so
        they get no gradient either way."""
        self.lora_layers(model)
        if all(hasattr(m, "_active_adapter") for m in self.layers):
            for m in self.layers:
                m._active_adapter = [adapter]
            model.base_model.active_adapter = adapter
            # the PeftModel's own record, which its forward reads its config by: left at a deleted
            # adapter it failed every later pass with KeyError (every client dropped, a new one made)
            if "active_adapter" in vars(model):
                model.active_adapter = adapter
            for p in self.params(model, adapter):
                p.requires_grad_(True)
        else:  # a PEFT without that attribute: its own (slow) switch
            model.set_adapter(adapter)
        self.active = adapter

    @contextmanager
    def off(self, model: Any) -> Iterator[None]:
        """Every adapter of ``model`` (a PeftModel) off inside: its LoRA layers give their base layers' outputs.
        PEFT's ``disable_adapter`` walks the model for its status first (~15 ms on the tiny model: a learner
        sampling call in turns enters this once a turn); this flips the flag on the layers found once, and leaves
        every ``requires_grad`` as it was."""
        layers = self.lora_layers(model)
        if not all(hasattr(m, "_disable_adapters") for m in layers):  # a PEFT without the flag: its own way
            with model.disable_adapter():
                yield
            return
        before = [m._disable_adapters for m in layers]
        for m in layers:
            m._disable_adapters = True
        try:
            yield
        finally:
            for m, was in zip(layers, before):
                m._disable_adapters = was

    def lora_layers(self, model: Any) -> list[Any]:
        """The model's LoRA layers (found once per set of adapters: the same list object until :meth:`changed`)."""
        if self.layers is None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        return self.layers

    def params(self, model: Any, adapter: str) -> list[torch.nn.Parameter]:
        """``adapter``'s LoRA parameters (the optimizer's)."""
        if adapter not in self.lists:
            tag = f".{adapter}."
            self.lists[adapter] = [p for n, p in model.named_parameters() if tag in n and "lora_" in n]
        return self.lists[adapter]
