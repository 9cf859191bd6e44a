"""PassGraphs: shared passes in bucketed shapes, replayed as CUDA graphs on a GPU (issue 53, item 2).

On a GPU a small shared pass costs its kernel launches, not its tokens (an H200, the 0.5B shape: ~5,800 launches a
step; one 16-token datum's forward_backward 0.173 s against 0.182 s for eight 128-token rows). A CUDA graph
replays a pass's kernels from one launch, but only for one shape and one code path, and a routed pass
(:class:`~otray.tinker.learner.mixed_lora.RowRouting`) changes both from pass to pass: its segments follow the
adapter groups of its rows.

A bucketed pass fixes both:

- its shape: rows padded to a power of two, its width to a power of two of at least ``MIN_WIDTH`` (the bucket);
  padded positions sit right of the real ones, which a causal model never lets them see (no attention mask is
  given), and padded rows read the first row's slot with a zero scale; their logits are cut off before the loss,
  so they add no gradient;
- its path: :class:`~otray.tinker.learner.mixed_lora.FixedRows`, each row's LoRA weights gathered from its layer's
  :class:`~otray.tinker.learner.lora_bank.LoraBank` by the row's slot: the same kernels whichever adapters (of one
  rank, on the same layers) the rows hold. Token ids, slots and scales are inputs refilled in place.

The banks take the gradient (as tensors sharing the banks' storage: the optimizer's in-place updates are what the
next pass reads) and after the backward each adapter of the pass gets its slice of it added to its parameters'
gradients, in one multi-tensor add. So an adapter equals one trained in passes of its own
(tests/tinker/test_pass_graphs.py).

A bucket's first pass runs eagerly; from its second, on a CUDA device, its forward and its backward are captured
(two graphs; every bucket's in one memory pool, safe because a bucket's backward always follows its own forward
before another bucket runs) and replayed. At most ``MAX_GRAPHS`` buckets keep graphs (each keeps its logits and
gradients; the least recently used is dropped). A capture that fails leaves its bucket eager for good and its
reason in :attr:`PassGraphs.failures`. A bank grown (a new adapter past its slots) drops every bucket: they read
the old banks.

Which passes: backward passes (a forward-only pass runs the routed path) whose rows are all of adapters of one rank,
one scale per adapter and the same layers, with no images, of at most ``max_tokens`` tokens once bucketed, on the
learner's main compute thread (a side lane's pass runs routed). The rest run the routed path, unchanged.

On the CPU (``capture=False``) the bucketed passes run eagerly: the path the tests check; whether graphs pay is
measured on a GPU (``benchmarks/tinker_shared_passes.py --parts kernels``, ``graphs`` rows; ``make gpu-check-tinker``).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from otray.actors.learner.core import pad_rows, sampled_logits, targets_logprobs
from otray.tinker.learner.lane_gate import LaneGate
from otray.tinker.learner.lora_bank import LoraBank
from otray.tinker.learner.mixed_lora import FixedRows, RowRouting
from otray.types import Datum

MAX_GRAPHS = 6  # buckets that keep captured graphs (each holds its logits, gradients and activations' pool share)
MIN_WIDTH = 16
GRAPH_TOKENS = 4096  # the largest bucket (its logits, their gradient: ~2.5 GB in bf16 for a 152k vocabulary)


def power_of_two(n: int, floor: int = 1) -> int:
    """The least power of two that is at least ``n`` and ``floor``."""
    out = 1
    while out < max(n, floor):
        out *= 2
    return out


@dataclass(frozen=True)
class BucketKey:
    """A bucketed pass's shape: ``rows`` x ``width`` tokens through rank-``rank`` adapters on ``layers`` (ids)."""

    rows: int
    width: int
    rank: int
    layers: frozenset[int]


@dataclass(frozen=True)
class _Plan:
    """What a set of adapters' rows need for a bucketed pass: their rank, layers and each one's slot and scale."""

    rank: int
    layers: frozenset[int]
    slots: dict[str, int]
    scales: dict[str, float]


class _Bucket:
    """One bucket's inputs (refilled in place each pass), the bank tensors that take its gradient, and its graphs
    once captured."""

    def __init__(self, key: BucketKey, model: Any, routing: RowRouting, banks: list, dtype: torch.dtype,
                 device: torch.device):
        self.key, self.model, self.routing = key, model, routing
        self.ids = torch.zeros((key.rows, key.width), dtype=torch.long, device=device)
        self.inputs: list[torch.Tensor] = []  # each layer's A bank, then its B bank, sharing the banks' storage
        self.members: list[dict[int, torch.nn.Parameter]] = []  # per input: slot -> the parameter it holds
        layers = {}
        for layer, bank_a, bank_b, members_a, members_b in banks:
            a, b = bank_a.detach().requires_grad_(True), bank_b.detach().requires_grad_(True)
            layers[layer] = (a, b)
            self.inputs += [a, b]
            self.members += [members_a, members_b]
        self.rows = FixedRows(torch.zeros(key.rows, dtype=torch.long, device=device),
                              torch.zeros((key.rows, 1, 1), dtype=dtype, device=device), layers)
        self.uses = 0
        self.graphs: Optional[tuple[Any, Any]] = None  # (forward, backward) CUDA graphs
        self.out: Optional[torch.Tensor] = None  # the logits (static when captured)
        self.grad_out: Optional[torch.Tensor] = None
        self.grads: Optional[Sequence[torch.Tensor]] = None

    def _logits(self) -> torch.Tensor:
        with torch.enable_grad(), self.routing.fixed_rows(self.rows):
            return self.model(input_ids=self.ids, use_cache=False).logits

    def forward(self) -> torch.Tensor:
        """The pass's logits (``(rows, width, vocab)``, the model's dtype), detached: :meth:`backward` follows."""
        if self.graphs is not None:
            self.graphs[0].replay()
            return self.out.detach()
        self.out = self._logits()
        return self.out.detach()

    def backward(self, grad: torch.Tensor) -> Sequence[Optional[torch.Tensor]]:
        """The gradient of every input bank for ``grad`` of the logits (static tensors when captured; None for a
        bank the pass did not reach)."""
        if self.graphs is not None:
            self.grad_out.copy_(grad)
            self.graphs[1].replay()
            return self.grads
        out, self.out = self.out, None
        return torch.autograd.grad(out, self.inputs, grad, allow_unused=True)

    def capture(self, pool: Any) -> None:
        """Capture the forward and the backward as CUDA graphs (warmed up on a side stream first, as CUDA graphs
        need: lazy initialisations and workspace allocations happen outside the capture)."""
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                out = self._logits()
                torch.autograd.grad(out, self.inputs, torch.zeros_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=pool):
            out = self._logits()
        grad_out = torch.zeros_like(out)
        with torch.cuda.graph(bwd, pool=pool):
            grads = torch.autograd.grad(out, self.inputs, grad_out, allow_unused=True)
        self.graphs, self.out, self.grad_out, self.grads = (fwd, bwd), out, grad_out, grads


class _Replay(torch.autograd.Function):
    """A bucket's logits as one autograd node: its backward runs the bucket's and adds each adapter's gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, bucket: _Bucket, owner: "PassGraphs",
                slots: tuple[int, ...]) -> torch.Tensor:
        ctx.bucket, ctx.owner, ctx.slots = bucket, owner, slots
        return bucket.forward()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.owner.add_grads(ctx.bucket, ctx.bucket.backward(grad), ctx.slots)
        return None, None, None, None


class PassGraphs:
    """The bucketed passes of one :class:`~otray.tinker.learner.adapter_learner.AdapterLearner`'s model
    (``capture``: replay them as CUDA graphs from a bucket's second pass; ``max_tokens``: the largest bucket)."""

    def __init__(self, model: Any, routing: RowRouting, bank: LoraBank, gate: LaneGate, device: str, *,
                 capture: bool, max_tokens: int):
        self.model, self.routing, self.bank, self.gate = model, routing, bank, gate
        self.device, self.capture, self.max_tokens = torch.device(device), capture, max_tokens
        self.buckets: collections.OrderedDict[BucketKey, _Bucket] = collections.OrderedDict()  # most recent last
        self.failures: dict[BucketKey, str] = {}  # buckets whose capture failed: they run eagerly
        self.counts = {"passes": 0, "replays": 0, "captures": 0}
        self._plans: dict[tuple, Optional[_Plan]] = {}
        self._generation = bank.generation
        self._pool: Any = None
        self._anchor = torch.zeros((), requires_grad=True)

    def logprobs(self, batch: list[Datum], adapters: list[str]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(logprobs, valid)`` of a backward micro-batch (row ``i`` through adapter ``adapters[i]``) as
        :func:`~otray.actors.learner.core.token_logprobs` gives them, from a bucketed pass; None when the batch
        is not one for a bucket (the caller runs the routed path)."""
        if self.gate.main is not None and threading.get_ident() != self.gate.main:
            return None  # a side lane's pass: buckets are the main lane's (one bucket's forward, then its backward)
        if any(d.images for d in batch):
            return None
        plan = self._plan(adapters)
        if plan is None:
            return None
        width = max(len(d) for d in batch)
        key = BucketKey(power_of_two(len(batch)), power_of_two(width, MIN_WIDTH), plan.rank, plan.layers)
        if key.rows * key.width > self.max_tokens:
            return None
        bucket = self._bucket(key)
        if bucket is None:
            return None
        pad = key.rows - len(batch)
        slots = [plan.slots[a] for a in adapters]
        bucket.ids.copy_(pad_rows([d.input_ids for d in batch] + [[]] * pad, key.width, 0, torch.long), non_blocking=True)
        bucket.rows.slots.copy_(torch.tensor(slots + [slots[0]] * pad), non_blocking=True)
        bucket.rows.scales.copy_(torch.tensor([plan.scales[a] for a in adapters] + [0.0] * pad).view(-1, 1, 1),
                                 non_blocking=True)
        self.counts["passes"] += 1
        self.counts["replays"] += bucket.graphs is not None
        logits = _Replay.apply(self._anchor, bucket, self, tuple(sorted(set(slots))))
        logits = sampled_logits(self.model, logits[:len(batch), :width])
        valid = pad_rows([[1.0] * len(d) for d in batch], width, 0.0, torch.float32, str(self.device))
        return targets_logprobs(logits, batch, str(self.device)), valid

    def add_grads(self, bucket: _Bucket, grads: Sequence[Optional[torch.Tensor]], slots: tuple[int, ...]) -> None:
        """Each training parameter in ``slots`` of the bucket's banks: its gradient += its slice of ``grads`` (a
        first gradient is a copy of it when the grads are a graph's static tensors, else the slice itself)."""
        have: list[torch.Tensor] = []
        add: list[torch.Tensor] = []
        first: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for grad, members in zip(grads, bucket.members):
            for s in slots if grad is not None else ():
                p = members.get(s)
                if p is None or not p.requires_grad:
                    continue
                if p.grad is None:
                    first.append((p, grad[s]))
                else:
                    have.append(p.grad)
                    add.append(grad[s])
        if have:
            torch._foreach_add_(have, add)
        if first:
            news = [g for _, g in first]
            if bucket.graphs is not None:  # the next replay overwrites them
                news = torch._foreach_mul(news, 1.0)
            for (p, _), g in zip(first, news):
                p.grad = g

    def _plan(self, adapters: list[str]) -> Optional[_Plan]:
        names = tuple(sorted(set(adapters)))
        key = (names, self.bank.version)
        if key not in self._plans:
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = self._make_plan(names)
        return self._plans[key]

    def _make_plan(self, names: tuple[str, ...]) -> Optional[_Plan]:
        """The plan of ``names``' rows, or None: one not in the bank, ranks or layers that differ, a scale that
        differs between an adapter's layers, or a parameter whose storage is not its slot's."""
        if any(n not in self.bank.slots for n in names):
            return None
        ranks = {self.bank.slots[n][0] for n in names}
        layers = {self.bank.layers_of(n) for n in names}
        if len(ranks) != 1 or len(layers) != 1:
            return None
        rank, on = ranks.pop(), layers.pop()
        banks = self.bank.layer_banks(rank, on)
        modules = {id(m): m for m in self.routing.layers()}
        if banks is None or any(layer not in modules for layer in on):
            return None
        slots = {n: self.bank.slots[n][1] for n in names}
        scales: dict[str, float] = {}
        for n in names:
            mine = {float(modules[layer].scaling[n]) for layer in on}
            if len(mine) != 1:
                return None
            scales[n] = mine.pop()
        for _, bank_a, bank_b, members_a, members_b in banks:
            for n, s in slots.items():
                pa, pb = members_a.get(s), members_b.get(s)
                if pa is None or pb is None or pa.data_ptr() != bank_a[s].data_ptr() or \
                        pb.data_ptr() != bank_b[s].data_ptr():
                    return None
        return _Plan(rank, on, slots, scales)

    def _bucket(self, key: BucketKey) -> Optional[_Bucket]:
        """``key``'s bucket, made (or captured, from its second pass on a GPU) as needed."""
        if self.bank.generation != self._generation:  # a bank was grown: every bucket reads the old ones
            self.buckets.clear()
            self._generation = self.bank.generation
        bucket = self.buckets.get(key)
        if bucket is None:
            banks = self.bank.layer_banks(key.rank, key.layers)
            if banks is None:
                return None
            modules = {id(m): m for m in self.routing.layers()}
            dtype = modules[min(key.layers)].base_layer.weight.dtype
            bucket = self.buckets[key] = _Bucket(key, self.model, self.routing, banks, dtype, self.device)
        self.buckets.move_to_end(key)
        bucket.uses += 1
        if self.capture and bucket.graphs is None and bucket.uses >= 2 and key not in self.failures:
            self._capture(bucket)
        while len(self.buckets) > MAX_GRAPHS:  # the least recently used bucket goes, its graphs and tensors with it
            self.buckets.popitem(last=False)
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            bucket.capture(self._pool)
            self.counts["captures"] += 1
        except Exception as e:  # noqa: BLE001 - the bucket stays eager; the reason is kept for the metrics
            bucket.graphs = None
            self.failures[bucket.key] = f"{type(e).__name__}: {e}"
