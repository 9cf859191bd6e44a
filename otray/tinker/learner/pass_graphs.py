"""PassGraphs: shared passes in bucketed shapes, replayed as CUDA graphs on a GPU (issue 53, item 2).

On a GPU a small shared pass costs its kernel launches, not its tokens (an H200, the 0.5B shape: ~5,800 launches a
step; one 16-token datum's forward_backward 0.173 s against 0.182 s for eight 128-token rows). A CUDA graph
replays a pass's kernels from one launch, but only for one shape and one code path, and a routed pass
(:class:`~otray.tinker.learner.mixed_lora.RowRouting`) changes both from pass to pass: its segments follow the
adapter groups of its rows.

A bucketed pass fixes both:

- its shape: its rows and its width rounded up to a bucket (:func:`bucket_size`: eight an octave, the width a
  multiple of 8). Padded positions sit right of the real ones, which a causal model never lets them see (no
  attention mask is given); padded rows read the first row's slot; the logits of both are cut off before the
  loss, so they add no gradient;
- its path: :class:`~otray.tinker.learner.fixed_rows.FixedRows`, each row's LoRA weights gathered from its layer's
  :class:`~otray.tinker.learner.lora_bank.LoraBank` by the row's slot: the same kernels whichever adapters (of one
  rank, on the same layers) the rows hold. Token ids, slots and (when adapters' scales differ) scales are inputs
  refilled in place; the banks are read in place, so the optimizer's updates are what the next pass sees.

The gathered rows take the gradient, and after the backward each adapter of the pass adds its rows' gradients to
its parameters' (multi-tensor adds: :meth:`PassGraphs.add_grads`). So an adapter equals one trained in passes of
its own (tests/tinker/test_pass_graphs.py).

A bucket's first pass runs eagerly; from its second, on a CUDA device, its forward and its backward are captured
(two graphs; a forward-only bucket's forward alone) and replayed. Every bucket's graphs share one memory pool,
safe because a bucket's backward always follows its own forward before another bucket runs. At most
``MAX_GRAPHS`` buckets are kept (each keeps its logits and gradients; the least recently used is dropped). A
capture that fails leaves its bucket eager for good and its reason in :attr:`PassGraphs.failures`. A bank grown
(a new adapter past its slots) drops every bucket: they read the old banks.

Which passes: forward_backward and forward passes (a bucket is one or the other) whose rows are all of adapters
of one rank, one scale per adapter and the same layers, with no images, of at most ``max_tokens`` tokens once
bucketed, on the learner's main compute thread (a side lane's pass runs routed). The rest run the routed path.

On the CPU (``capture=False``) the bucketed passes run eagerly, at 0.88-1.00x the routed pass's cost
(docs/notes/tinker.md): the path the tests check. Whether graphs pay is measured on a GPU
(``benchmarks/tinker_shared_passes.py --parts kernels``, ``graphs_*`` rows; ``make gpu-check-tinker``).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from otray.actors.learner.core import pad_rows, sampled_logits, targets_logprobs
from otray.tinker.learner.fixed_rows import FixedRows
from otray.tinker.learner.lane_gate import LaneGate
from otray.tinker.learner.lora_bank import LoraBank
from otray.tinker.learner.mixed_lora import RowRouting
from otray.types import Datum

MAX_GRAPHS = 6  # buckets kept, with their graphs (each holds its logits, gradients and its share of the pool)
WIDTH_STEP = 8  # a bucket's width is a multiple of it
GRAPH_TOKENS = 4096  # the largest bucket (its logits, their gradient: ~2.5 GB in bf16 for a 152k vocabulary)


def bucket_size(n: int, step: int = 1) -> int:
    """``n`` rounded up to a bucket: to a multiple of ``step`` and of an eighth of the least power of two that holds
    ``n``; so eight buckets an octave, none more than a quarter above what it holds (19 tokens, ``step`` 8: 24;
    100: 112). (Powers of two padded the benchmark's 19-token rows to 32: the CPU's pass 1.7x the matmuls.)"""
    step = max(step, 2 ** max(0, (max(n, 1) - 1).bit_length() - 3))
    return -(-max(n, 1) // step) * step


@dataclass(frozen=True)
class BucketKey:
    """A bucketed pass's shape: ``rows`` x ``width`` tokens through rank-``rank`` adapters on ``layers`` (ids), with
    one LoRA scale for all (``scale``) or each row its own (None); ``grad``: a forward_backward's (else a
    forward's: no autograd graph, no backward)."""

    rows: int
    width: int
    rank: int
    layers: frozenset[int]
    scale: Optional[float]
    grad: bool = True


@dataclass(frozen=True)
class _Plan:
    """What a set of adapters' rows need for a bucketed pass: their rank, layers and each one's slot and scale
    (``scale``: theirs when they all have one, the usual case, else None)."""

    rank: int
    layers: frozenset[int]
    slots: dict[str, int]
    scales: dict[str, float]
    scale: Optional[float]


class _Bucket:
    """One bucket's inputs (refilled in place each pass), and its graphs once captured."""

    def __init__(self, key: BucketKey, model: Any, routing: RowRouting, banks: list, dtype: torch.dtype,
                 device: torch.device):
        self.key, self.model, self.routing = key, model, routing
        self.ids = torch.zeros((key.rows, key.width), dtype=torch.long, device=device)
        self.members = {layer: (members_a, members_b) for layer, _, _, members_a, members_b in banks}
        self.rows = FixedRows(torch.zeros(key.rows, dtype=torch.long, device=device),
                              {layer: (bank_a, bank_b) for layer, bank_a, bank_b, _, _ in banks}, key.scale,
                              torch.zeros((key.rows, 1, 1), dtype=dtype, device=device) if key.scale is None else None)
        self.uses = 0
        self.graphs: Optional[tuple[Any, Any]] = None  # (forward, backward) CUDA graphs
        self.out: Optional[torch.Tensor] = None  # the logits (static when captured)
        self.taken: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # the pass's gathered weights (FixedRows)
        self.grad_out: Optional[torch.Tensor] = None
        self.grads: Optional[Sequence[Optional[torch.Tensor]]] = None

    def _logits(self) -> torch.Tensor:
        self.rows.taken = []
        with torch.set_grad_enabled(self.key.grad), self.routing.fixed_rows(self.rows):
            out = self.model(input_ids=self.ids, use_cache=False).logits
        self.taken = self.rows.taken
        return out

    def _inputs(self) -> list[torch.Tensor]:
        return [w for _, a, b in self.taken for w in (a, b)]

    def forward(self) -> torch.Tensor:
        """The pass's logits (``(rows, width, vocab)``, the model's dtype), detached; in a forward_backward's bucket
        :meth:`backward` follows."""
        if self.graphs is not None:
            self.graphs[0].replay()
            return self.out.detach()
        self.out = self._logits()
        return self.out.detach()

    def backward(self, grad: torch.Tensor) -> Sequence[Optional[torch.Tensor]]:
        """The gradient of each gathered weight (:attr:`taken`: each layer's A rows, then its B rows) for ``grad``
        of the logits (static tensors when captured; None where the pass did not reach)."""
        if self.graphs is not None:
            self.grad_out.copy_(grad)
            self.graphs[1].replay()
            return self.grads
        out, self.out = self.out, None
        return torch.autograd.grad(out, self._inputs(), grad, allow_unused=True)

    def capture(self, pool: Any) -> None:
        """Capture the forward and the backward as CUDA graphs (warmed up on a side stream first, as CUDA graphs
        need: lazy initialisations and workspace allocations happen outside the capture)."""
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                out = self._logits()
                if self.key.grad:
                    torch.autograd.grad(out, self._inputs(), torch.zeros_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: the actor's other threads (Ray's, asyncio's) may touch CUDA meanwhile. transformers sees the
        # capture (is_tracing) and builds the causal mask on the device instead of checking it on the host
        with torch.cuda.graph(fwd, pool=pool, capture_error_mode="thread_local"):
            out = self._logits()
        if not self.key.grad:
            self.graphs, self.out = (fwd, None), out
            return
        grad_out = torch.zeros_like(out)
        with torch.cuda.graph(bwd, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(out, self._inputs(), grad_out, allow_unused=True)
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

    def logprobs(self, batch: list[Datum], adapters: list[str], backward: bool = True
                 ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(logprobs, valid)`` of a micro-batch (row ``i`` through adapter ``adapters[i]``; ``backward``: a
        forward_backward's, whose logprobs take the gradient) as :func:`~otray.actors.learner.core.token_logprobs`
        gives them, from a bucketed pass; None when the batch is not one for a bucket (the caller runs the routed
        path)."""
        if self.gate.main is not None and threading.get_ident() != self.gate.main:
            return None  # a side lane's pass: buckets are the main lane's (one bucket's forward, then its backward)
        if any(d.images for d in batch):
            return None
        plan = self._plan(adapters)
        if plan is None:
            return None
        width = max(len(d) for d in batch)
        key = BucketKey(bucket_size(len(batch)), bucket_size(width, WIDTH_STEP), plan.rank, plan.layers, plan.scale,
                        backward)
        if key.rows * key.width > self.max_tokens:
            return None
        bucket = self._bucket(key)
        if bucket is None:
            return None
        pad = key.rows - len(batch)
        slots = [plan.slots[a] for a in adapters]
        bucket.ids.copy_(pad_rows([d.input_ids for d in batch] + [[]] * pad, key.width, 0, torch.long), non_blocking=True)
        bucket.rows.slots.copy_(torch.tensor(slots + [slots[0]] * pad), non_blocking=True)
        if bucket.rows.scales is not None:
            bucket.rows.scales.copy_(torch.tensor([plan.scales[a] for a in adapters] + [0.0] * pad).view(-1, 1, 1),
                                     non_blocking=True)
        self.counts["passes"] += 1
        self.counts["replays"] += bucket.graphs is not None
        logits = _Replay.apply(self._anchor, bucket, self, tuple(slots)) if backward else bucket.forward()
        logits = sampled_logits(self.model, logits[:len(batch), :width])
        valid = pad_rows([[1.0] * len(d) for d in batch], width, 0.0, torch.float32, str(self.device))
        return targets_logprobs(logits, batch, str(self.device)), valid

    def add_grads(self, bucket: _Bucket, grads: Sequence[Optional[torch.Tensor]], slots: tuple[int, ...]) -> None:
        """Each training parameter of the pass's adapters: its gradient += the gradients of the weights its rows
        gathered (``slots``: each real row's slot; ``grads``: per gathered weight, ``(rows, ...)``). Added in
        rounds, the ``j``-th row of each adapter in round ``j``, so that no multi-tensor add writes one tensor
        twice; a first gradient is the row's itself (a copy when it is a graph's static tensor)."""
        by_slot: dict[int, list[int]] = {}
        for row, s in enumerate(slots):
            by_slot.setdefault(s, []).append(row)
        weights = [(members, grad) for (layer, _, _), pair in zip(bucket.taken, zip(grads[::2], grads[1::2]))
                   for members, grad in zip(bucket.members[layer], pair) if grad is not None]
        for j in range(max(map(len, by_slot.values()), default=0)):
            have: list[torch.Tensor] = []
            add: list[torch.Tensor] = []
            first: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
            for members, grad in weights:
                for s, rows in by_slot.items():
                    p = members.get(s) if j < len(rows) else None
                    if p is None or not p.requires_grad:
                        continue
                    if p.grad is None:
                        first.append((p, grad[rows[j]]))
                    else:
                        have.append(p.grad)
                        add.append(grad[rows[j]])
            if have:
                torch._foreach_add_(have, add)
            if first:
                # in the parameter's layout (a fused AdamW walks both as flat memory; fixed_rows._RowUpdate makes
                # them so), and copied when the next replay would overwrite them
                news = [g if g.is_contiguous() else g.contiguous() for _, g in first]
                if bucket.graphs is not None:
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
        return _Plan(rank, on, slots, scales, scales[names[0]] if len(set(scales.values())) == 1 else None)

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
