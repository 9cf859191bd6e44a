"""LearnerRank: one rank of a sharded learner group (``resources.learner_workers: N > 1``).

Each rank is a :class:`~otray.actors.learner.policy_learner.PolicyLearner` whose model, after
:meth:`LearnerRank.join`, is sharded with torch FSDP2 (``fully_shard``: each decoder layer,
then the whole model) over one ``torch.distributed`` process group of N ranks (NCCL on
GPUs, gloo on CPU). What is sharded:

- full-parameter training: every parameter, its gradient and its AdamW state (1/N each);
- LoRA: the frozen base weights and the adapters alike (both are FSDP parameters); the
  optimizer only ever holds the adapters' state, sharded as well.

A layer's parameters are gathered for its forward and its backward and freed after, so a
rank holds about 1/N of the training state plus one layer unsharded. The ranks never
decide anything themselves: :class:`~otray.actors.learner.group.LearnerGroup` hands each
its micro-batches (every rank the same number: an empty one is an idle pass, so that every
rank joins every collective) and the whole batch's loss normalizer. Gradients are summed
across ranks, not averaged (``set_gradient_divide_factor(1)``): each rank's loss is already
its share of the global sum, so the update equals one learner's on the whole batch.

Checkpoints are ``torch.distributed.checkpoint`` directories (``dcp/``, one file per rank
plus ``.metadata``; :mod:`otray.actors.learner.state`), loadable by any number of ranks,
including a plain PolicyLearner. Weights leave a rank one tensor at a time
(``full_tensor()`` then a CPU copy on rank 0), never the whole model unsharded on a device.
"""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from otray.actors.learner.core import token_logprobs
from otray.actors.learner.policy_learner import PolicyLearner, slow_vision
from otray.actors.learner.state import load_sharded, read_meta, training_state, write_meta
from otray.records import CheckpointMeta
from otray.timing import busy
from otray.types import Datum, ModelLoadError, WeightUpdate


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer (HF's ``model.layers``, under PEFT's wrappers too): the
    first ``ModuleList`` with more than one entry; empty when there is none."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            return list(module)
    return []


def full_tensors(state: dict[str, Any], keep: bool):
    """``(name, CPU tensor)`` for each entry of a sharded state dict, gathered one at a time (every rank
    must iterate, because each gather is a collective); the tensors are kept only where ``keep``."""
    from torch.distributed.tensor import DTensor

    for name, value in state.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            yield name, full.detach().to("cpu", copy=True)
        del full


class LearnerRank(PolicyLearner):
    """PolicyLearner sharded across a process group; driven only by a LearnerGroup."""

    whole_model_on_device = False  # loaded on the CPU; fully_shard moves each rank's shards to its device

    def __init__(self, model_path: str, *, rank: int, world_size: int, **kwargs: Any):
        super().__init__(model_path, **kwargs)
        self.rank, self.world_size = rank, world_size

    def address(self) -> str:
        """``tcp://IP:PORT`` on this rank's node for the process group's rendezvous (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, init_method: str, timeout_s: float) -> int:
        """Join the process group (every rank at once) and shard the model; returns this rank.
        ``timeout_s`` bounds every collective: a rank that waits longer for a dead peer raises."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        on_gpu = self.device.startswith("cuda")
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))
        mesh = init_device_mesh("cuda" if on_gpu else "cpu", (self.world_size,))
        for layer in decoder_layers(self.model):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        slow_vision(self.model, self.vision_lr_scale)  # (the sharded parameters are new objects)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is its share already
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum (PREMUL_SUM)
        self._idle = Datum([0], [0], [0.0], [0.0], [0.0])
        return self.rank

    def idle_pass(self, backward: bool) -> None:
        """One token through the model (and a zero loss back): joins the gathers and reduce-scatters
        of a micro-batch this rank does not have; adds exactly zero to every gradient."""
        lp, _ = token_logprobs(self.model, [self._idle], self.device)
        if backward:
            (lp.sum() * 0.0).backward()

    @busy
    def accumulate(self, *args: Any, **kwargs: Any) -> Any:
        """PolicyLearner.accumulate on this rank's micro-batches, counted as busy time."""
        return super().accumulate(*args, **kwargs)

    @busy
    def logprobs_of(self, *args: Any, **kwargs: Any) -> Any:
        """PolicyLearner.logprobs_of on this rank's micro-batches, counted as busy time."""
        return super().logprobs_of(*args, **kwargs)

    # ------------------------------------------------------------------ weights out

    @busy
    def weights(self, transport: str = "object_store", dtype: str | None = None) -> WeightUpdate | None:
        """The current weights (adapter or every entry, as PolicyLearner's), gathered tensor by tensor;
        rank 0 returns them (over ``transport``), the others None."""
        keep = self.rank == 0
        if self.is_lora:
            from peft import get_peft_model_state_dict

            tensors = dict(full_tensors(get_peft_model_state_dict(self.model), keep))
            return self.publisher.update(tensors, self.version, "lora", self._lora_config_dict(), transport,
                                         dtype) if keep else None
        tensors = dict(full_tensors(self.model.state_dict(), keep))
        return self.publisher.update(tensors, self.version, "full", None, transport, dtype) if keep else None

    def export(self, path: str) -> str:
        """Rank 0 writes the HF model (or PEFT adapter) from the gathered state (see PolicyLearner.export)."""
        full = dict(full_tensors(self.model.state_dict(), self.rank == 0))
        if self.rank != 0:
            return path
        out = self.save_pretrained(path, full)
        config = Path(out) / "config.json"  # FSDP2 renamed the class (FSDPQwen2...); vLLM reads this name
        if config.exists():
            data = json.loads(config.read_text())
            data["architectures"] = [a.removeprefix("FSDP") for a in data.get("architectures") or []]
            config.write_text(json.dumps(data, indent=2))
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, path: str, extra_state: dict[str, Any] | None = None) -> dict[str, bytes]:
        """Every rank writes its shard into ``path/dcp``; rank 0 adds ``meta.json`` and its RNG state.
        Returns the files this rank wrote (rank > 0), for the group to copy next to rank 0's."""
        import torch.distributed.checkpoint as dcp

        if extra_state is not None:
            self.extra_state = extra_state
        out = Path(path)
        (out / "dcp").mkdir(parents=True, exist_ok=True)
        dcp.save(training_state(self.model, self.optimizer), checkpoint_id=str(out / "dcp"))
        if self.rank == 0:
            write_meta(out, replace(self.meta(), sharded=self.world_size))
            return {}
        return {f.name: f.read_bytes() for f in (out / "dcp").glob(f"__{self.rank}_*")}

    def add_files(self, path: str, files: dict[str, bytes]) -> None:
        """Write other ranks' shard files into ``path/dcp`` (rank 0, whose node keeps the checkpoint)."""
        for name, data in files.items():
            (Path(path) / "dcp" / Path(name).name).write_bytes(data)

    def packed(self, path: str) -> bytes:
        """The checkpoint directory ``path`` as one blob (rank 0, for ranks on other nodes)."""
        from otray.checkpoints import pack_dir

        return pack_dir(path)

    def load_state(self, path: str, blob: bytes | None = None) -> CheckpointMeta:
        """Load a sharded checkpoint (any number of ranks saved it); ``blob`` is rank 0's copy of the
        directory, packed, for a rank on another node."""
        if blob is not None:
            from otray.checkpoints import unpack_dir

            unpack_dir(blob, path)
        src = Path(path)
        meta = read_meta(src, self.lora.rank)
        if not meta.sharded:
            raise ModelLoadError(f"checkpoint {src} was saved by a single learner (resources.learner_workers: 1); "
                                 "resume it with learner_workers: 1 (a sharded checkpoint loads into any number)")
        self.optimizer = load_sharded(self.model, self.optimizer, src, meta)
        self.restore_counters(src, meta)
        return meta
