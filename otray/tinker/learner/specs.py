"""What a training client asks of its adapter and its optimizer: :class:`AdapterSpec` (Tinker's ``LoraConfig``)
and :class:`AdamStep` (Tinker's ``AdamParams``). Plain frozen dataclasses without torch, so the processes
that only pass them on (the TinkerService, the Serve replicas) need not import it.

Runs in every Tinker process: the SharedLearner and LoraSampler actors, the TinkerService."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """A training client's LoRA: Tinker's ``LoraConfig`` plus the scale (alpha) this service uses."""

    rank: int
    seed: Optional[int] = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = 32.0

    def target_modules(self) -> list[str]:
        return [*(ATTN if self.train_attn else ()), *(MLP if self.train_mlp else ()),
                *(("lm_head",) if self.train_unembed else ())]


@dataclass(frozen=True)
class AdamStep:
    """Tinker's ``AdamParams``: ``grad_clip_norm`` 0 means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
