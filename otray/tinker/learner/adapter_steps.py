"""AdapterSteps: the optimizer side of the :class:`~otray.tinker.learner.adapter_learner.AdapterLearner`.

Each adapter keeps its own ``torch.optim.AdamW`` (made at its first step; saved and loaded with it) and its
own step count. Steps of several adapters are answered in two halves (:meth:`AdapterSteps.answers`): what a
step answers (its gradient norm and count) is known once its gradients are clipped, and the update that
applies them (one fused AdamW call over every ready adapter's tensors, :mod:`fused_adamw`) may run after the
answers are sent, as long as it runs before anything else touches those adapters. An update that fails
after its answers leaves its adapters refused by name (:meth:`AdapterSteps.check`).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

from typing import Any, Callable

import torch

from otray.actors.learner.core import adamw_step, new_adamw
from otray.tinker.learner.fused_adamw import clip_groups, fused_adamw_update
from otray.tinker.learner.specs import AdamStep

Answer = dict[str, float]


def answer(norm: float, p: AdamStep, step: int) -> Answer:
    """What an optimizer step answers: its gradient norm before clipping, learning rate and step count."""
    return {"grad_norm:mean": norm, "learning_rate:mean": p.learning_rate, "step:max": float(step)}


class AdapterSteps:
    """Each adapter's AdamW (``optimizers``), step count (``steps``) and, for an update that failed after it
    was answered, why (``failed``)."""

    def __init__(self) -> None:
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.steps: dict[str, int] = {}
        self.failed: dict[str, str] = {}

    def add(self, adapter: str) -> None:
        self.steps[adapter] = 0

    def forget(self, adapter: str) -> None:
        for table in (self.optimizers, self.steps, self.failed):
            table.pop(adapter, None)

    def check(self, adapter: str) -> None:
        """Refuse an adapter whose optimizer step failed after it was answered."""
        if adapter in self.failed:
            raise RuntimeError(f"adapter {adapter!r}: its last optimizer step was answered, then failed while "
                               f"updating its weights ({self.failed[adapter]}); its weights may be partly "
                               f"updated: load a saved checkpoint into a new training client")

    def step(self, adapter: str, params: list[torch.nn.Parameter], p: AdamStep) -> Answer:
        """One AdamW step of ``adapter``'s ``params`` on their accumulated gradients, now; zeroes them."""
        opt = self.optimizers.get(adapter)
        if opt is None:
            opt = self.optimizers[adapter] = new_adamw(params, lr=p.learning_rate)
        norm = adamw_step(opt, params, learning_rate=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps,
                          weight_decay=p.weight_decay, grad_clip=p.grad_clip_norm if p.grad_clip_norm > 0 else None)
        self.steps[adapter] += 1
        return answer(norm, p, self.steps[adapter])

    def fusable(self, adapter: str, params: list[torch.nn.Parameter]) -> bool:
        """Past its first step with a gradient on every tensor: ready for the fused call."""
        opt = self.optimizers.get(adapter)  # (state is kept for these params only: a count, not 59 tensor hashes)
        return (opt is not None and adapter not in self.failed and bool(opt.defaults.get("fused"))
                and len(opt.state) == len(params) and all(p.grad is not None for p in params))

    def answers(self, works: list[tuple[str, AdamStep]], params_of: Callable[[str], list[torch.nn.Parameter] | None],
                one: Callable[[str, AdamStep], Answer]) -> tuple[list[Answer | Exception], Callable[[], None]]:
        """Several adapters' steps: each one's answer, and the update that applies them, to run next on this
        thread. Adapters :meth:`fusable` with the same settings share one fused AdamW call; the others go
        through ``one`` (a step of its own, updated here); an adapter ``params_of`` has no parameters for
        (``None``: gone) goes through ``one`` too, which raises its error: each failure is that adapter's alone."""
        outs: list[Any] = [None] * len(works)
        together: dict[AdamStep, list[tuple[int, str, list[torch.nn.Parameter]]]] = {}
        for i, (adapter, step) in enumerate(works):
            params = params_of(adapter)
            if params is not None and self.fusable(adapter, params):
                together.setdefault(step, []).append((i, adapter, params))
                continue
            try:
                outs[i] = one(adapter, step)
            except Exception as e:  # noqa: BLE001 - this adapter's own failure
                outs[i] = e
        for p, members in together.items():
            for (i, adapter, _), norm in zip(members, clip_groups([m[2] for m in members], p.grad_clip_norm)):
                self.steps[adapter] += 1
                outs[i] = answer(norm, p, self.steps[adapter])

        def update() -> None:
            for p, members in together.items():
                try:
                    fused_adamw_update([m[2] for m in members], [self.optimizers[m[1]] for m in members],
                                       lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps,
                                       weight_decay=p.weight_decay)
                except Exception as e:  # noqa: BLE001 - answered already: its adapters are refused from now on
                    self.failed.update({m[1]: f"{type(e).__name__}: {e}" for m in members})
        return outs, update
