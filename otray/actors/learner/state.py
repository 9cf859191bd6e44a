"""Learner checkpoints: reading their ``meta.json``, the counters and RNG every kind restores, and
the sharded kind (``torch.distributed.checkpoint``, written by :class:`~otray.actors.learner.rank.LearnerRank`).

Two layouts share ``meta.json`` (step, version, LoRA spec, model path, job ``extra_state``) and
``rng.pt``:

- a PolicyLearner's: ``trainable.pt`` (every trainable tensor, whole) and ``optimizer.pt``;
- a sharded group's (``"sharded": N`` in the meta): ``dcp/``, the trainable tensors and the AdamW
  state keyed by parameter name, one file per rank plus ``.metadata``. ``dcp.load`` reshards on
  read, so any number of ranks loads it, a plain PolicyLearner included (no process group:
  torch.distributed.checkpoint then reads every shard itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from otray.actors.learner.core import new_adamw, trainable
from otray.device import rng_state, set_rng_state
from otray.records import CheckpointMeta
from otray.types import ModelLoadError


def read_meta(src: Path, lora_rank: int) -> CheckpointMeta:
    """A checkpoint's ``meta.json``; a clear error when there is none or its LoRA-ness differs."""
    if not (src / "meta.json").exists():
        raise ModelLoadError(f"no learner checkpoint at {str(src)!r} (expected meta.json there)")
    meta = CheckpointMeta.from_json(json.loads((src / "meta.json").read_text()))
    if (meta.lora_rank > 0) != (lora_rank > 0):
        raise ModelLoadError(f"checkpoint {src} has lora rank {meta.lora_rank}, this learner {lora_rank}")
    return meta


def write_meta(out: Path, meta: CheckpointMeta) -> None:
    """``meta.json`` and ``rng.pt`` (this process's RNG state, :func:`otray.device.rng_state`) into ``out``."""
    torch.save(rng_state(), out / "rng.pt")
    (out / "meta.json").write_text(json.dumps(meta.to_json(), indent=1, default=list))


def save_whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, out: Path) -> None:
    """A single learner's tensors: every trainable one whole, and the optimizer's state dict."""
    tensors = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(tensors, out / "trainable.pt")
    torch.save(optimizer.state_dict() if optimizer else None, out / "optimizer.pt")


def load_whole(model: torch.nn.Module, src: Path, device: str) -> torch.optim.Optimizer | None:
    """:func:`save_whole`'s files back into ``model`` (saved on any device); the optimizer they hold,
    rebuilt over the model's trainable parameters on ``device`` (None if none was saved)."""
    trained = torch.load(src / "trainable.pt", weights_only=True, map_location="cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in trained.items():
            params[name].copy_(value)
    opt_state = torch.load(src / "optimizer.pt", weights_only=False, map_location=device)
    if opt_state is None:
        return None
    optimizer = new_adamw(trainable(model))
    optimizer.load_state_dict(opt_state)
    return optimizer


def restore_rng(src: Path) -> None:
    """This process's RNG state as the checkpoint saved it (:func:`write_meta`)."""
    set_rng_state(torch.load(src / "rng.pt", weights_only=False))


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a sharded checkpoint holds: trainable tensors and (if any) the optimizer's state, keyed by
    parameter name, as this process holds them (shards under FSDP, whole tensors otherwise)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(ignore_frozen_params=True)
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=opts)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=opts)
    return state


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, src: Path,
                 meta: CheckpointMeta) -> torch.optim.Optimizer | None:
    """Fill ``model`` (and ``optimizer``, created if the checkpoint has one) from ``src/dcp``; returns
    the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if not (src / "dcp" / ".metadata").exists():
        raise ModelLoadError(f"sharded checkpoint {str(src)!r} has no dcp/.metadata: it was not fully written")
    if meta.optimizer and optimizer is None:
        optimizer = new_adamw(trainable(model))
    state = training_state(model, optimizer if meta.optimizer else None)
    dcp.load(state, checkpoint_id=str(src / "dcp"))
    opts = StateDictOptions(ignore_frozen_params=True)
    set_model_state_dict(model, state["model"], options=opts)
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=opts)
    return optimizer
