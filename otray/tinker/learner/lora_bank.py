"""LoraBank: on each LoRA layer, the training adapters' weights of one rank in one stacked tensor, each adapter's
parameters views of its slot.

A shared pass multiplies k small users' rows by their k adapters' weights in batched matmuls, which take the weights
stacked, ``(k, r, in)`` and ``(k, out, r)`` (:mod:`otray.tinker.learner.mixed_lora`). Stacked anew in every pass,
that was a copy of all k adapters' weights on every layer, cold in the cache: 58 copies in 8 one-datum users' step
on the tiny model. Here each training adapter gets a slot (one per rank, the same on every layer), and its
``lora_A`` / ``lora_B`` weights are re-pointed (``Parameter.data``) at their slot of that layer's bank: PEFT, the
optimizer and checkpoints see the same parameter objects, updated in place, and a pass over adapters in
consecutive slots reads a view of the bank (:meth:`LoraBank.stacked`); other sets take one ``index_select``.
8 one-datum users' step of the tiny model computes 706 operators, 1.01x one user's step (836 and 1.17x with the
stacks per pass and a tensor per padded row, ``core.pad_rows`` then; ``benchmarks/tinker_shared_passes.py
--parts kernels``): on a GPU, where such a step is bound
by kernel launches, that is its cost; on this CPU the step's time moved within noise (34.8 against 35.3 ms, ten
rounds side by side, session 65).

A bank grows by doubling (its parameters re-pointed at the new one) and keeps a freed slot for the next adapter
of its rank. ``version`` changes whenever a view handed out may be stale (a bank grown, an adapter placed or
released): :class:`~otray.tinker.learner.mixed_lora.RowRouting` keys the stacks it keeps by it; ``generation``
changes only when a bank tensor is made or grown (:class:`~otray.tinker.learner.pass_graphs.PassGraphs` captures
the banks themselves, and keys its graphs by it).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

Key = tuple[int, str, int]  # (id of the LoRA layer, "A" or "B", rank)


@dataclass(frozen=True)
class Stacked:
    """How a layer's bank gives the stacked weights of some adapters (:meth:`LoraBank.stacked`): ``a`` and ``b``
    are the adapters' rows of the banks (views) when their slots are consecutive, else the whole banks with
    ``rows`` the slots to take."""

    a: torch.Tensor
    b: torch.Tensor
    rows: Optional[torch.Tensor] = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, r, in)`` and ``(k, out, r)``: views, or one copy each for slots that are not consecutive."""
        if self.rows is None:
            return self.a, self.b
        return self.a.index_select(0, self.rows), self.b.index_select(0, self.rows)


class LoraBank:
    """The banks of a PEFT model's LoRA layers and which slot each training adapter has (:meth:`place`)."""

    def __init__(self) -> None:
        self.slots: dict[str, tuple[int, int]] = {}  # adapter -> (rank, slot)
        self.version = 0
        self.generation = 0
        self._layers: dict[str, frozenset[int]] = {}  # adapter -> the ids of the layers it is on
        self._banks: dict[Key, torch.Tensor] = {}
        self._members: dict[Key, dict[int, torch.nn.Parameter]] = {}  # bank -> slot -> its parameter
        self._where: dict[int, tuple[Key, int]] = {}  # id(parameter) -> (its bank, its slot)

    def place(self, adapter: str, layers: Sequence[Any]) -> None:
        """Give ``adapter`` (just added to ``layers``, the model's LoRA layers) a slot and move its weights there."""
        mine = [m for m in layers if adapter in getattr(m, "lora_A", {})]
        if not mine or adapter in self.slots:
            return
        rank = mine[0].lora_A[adapter].weight.shape[0]
        if any(m.lora_A[adapter].weight.shape[0] != rank for m in mine):
            return  # a rank per layer (PEFT's rank_pattern): its slot would not be one across layers; stacked per pass
        taken = {s for r, s in self.slots.values() if r == rank}
        slot = next(s for s in range(len(taken) + 1) if s not in taken)
        self.slots[adapter] = (rank, slot)
        self._layers[adapter] = frozenset(id(m) for m in mine)
        with torch.no_grad():
            for m in mine:
                for kind, p in (("A", m.lora_A[adapter].weight), ("B", m.lora_B[adapter].weight)):
                    key = (id(m), kind, p.shape[0] if kind == "A" else p.shape[1])
                    bank = self._room(key, slot, p)
                    bank[slot].copy_(p)
                    p.data = bank[slot]
                    self._members.setdefault(key, {})[slot] = p
                    self._where[id(p)] = (key, slot)
        self.version += 1

    def release(self, adapter: str) -> None:
        """Forget ``adapter``'s slot (its layers dropped it): the next adapter of its rank may take it."""
        if adapter not in self.slots:
            return
        rank, slot = self.slots.pop(adapter)
        self._layers.pop(adapter, None)
        for key, members in self._members.items():
            p = members.pop(slot, None) if key[2] == rank else None
            if p is not None:
                self._where.pop(id(p), None)
        self.version += 1

    def _room(self, key: Key, slot: int, like: torch.Tensor) -> torch.Tensor:
        """The bank ``key`` with room for ``slot`` (made or doubled, its parameters re-pointed)."""
        bank = self._banks.get(key)
        if bank is not None and slot < bank.shape[0]:
            return bank
        size = max(8, 2 * (bank.shape[0] if bank is not None else 0), slot + 1)
        grown = like.new_zeros((size, *like.shape))
        if bank is not None:
            grown[:bank.shape[0]].copy_(bank)
            for s, p in self._members.get(key, {}).items():
                p.data = grown[s]
        self._banks[key] = grown
        self.version += 1
        self.generation += 1
        return grown

    def stacked(self, layer: Any, a: list[torch.nn.Parameter], b: list[torch.nn.Parameter]) -> Optional[Stacked]:
        """``a`` and ``b`` (the ``lora_A`` / ``lora_B`` weights of some adapters on ``layer``, in row order) as
        rows of this layer's banks; None when one of them is not (still) its slot's view."""
        where = [self._where.get(id(p)) for p in (*a, *b)]
        if any(w is None for w in where):
            return None
        keys = {w[0] for w in where}
        slots = [w[1] for w in where[:len(a)]]
        if len(keys) != 2 or slots != [w[1] for w in where[len(a):]] or any(k[0] != id(layer) for k in keys):
            return None
        bank_a, bank_b = self._banks[where[0][0]], self._banks[where[len(a)][0]]
        if any(p.data_ptr() != bank_a[s].data_ptr() for p, s in zip(a, slots)) or \
                any(p.data_ptr() != bank_b[s].data_ptr() for p, s in zip(b, slots)):
            return None  # a parameter was given other storage behind the bank's back: stack it as it is
        lo = slots[0]
        if slots == list(range(lo, lo + len(slots))):
            return Stacked(bank_a[lo:lo + len(slots)], bank_b[lo:lo + len(slots)])
        return Stacked(bank_a, bank_b, torch.tensor(slots, dtype=torch.long, device=bank_a.device))

    def layers_of(self, adapter: str) -> frozenset[int]:
        """The ids of the LoRA layers ``adapter`` (placed) is on."""
        return self._layers[adapter]

    def layer_banks(self, rank: int, layers: frozenset[int]) -> Optional[list[tuple[int, torch.Tensor, torch.Tensor,
                                                                                     dict[int, torch.nn.Parameter],
                                                                                     dict[int, torch.nn.Parameter]]]]:
        """For each layer of ``layers`` (ids): its rank-``rank`` banks ``(slots, r, in)`` and ``(slots, out, r)`` and
        which parameter each slot of them holds (slot -> ``lora_A`` / ``lora_B`` weight); None when one is missing."""
        out = []
        for layer in sorted(layers):
            a, b = (layer, "A", rank), (layer, "B", rank)
            if a not in self._banks or b not in self._banks:
                return None
            out.append((layer, self._banks[a], self._banks[b], self._members.get(a, {}), self._members.get(b, {})))
        return out
