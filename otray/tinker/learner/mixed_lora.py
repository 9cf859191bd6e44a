"""Several LoRA adapters in one pass: each row of a batch goes through its own adapter.

PEFT runs one active adapter at a time in training (its ``adapter_names`` routing refuses a model in
train mode), so ten users' one-datum steps used to be ten passes over the base model, each bound by
kernel launches rather than tokens. :class:`RowRouting` replaces the forward of every LoRA layer once
with one that, while a pass is *routed* (:meth:`RowRouting.routed`), computes the base layer on the
whole batch and adds each adapter's low-rank update to its own rows only: rows are grouped by adapter
(contiguous). Small groups (a one-datum user's row) of one rank are batched: two ``bmm`` over their stacked
weights per layer, whatever their number; a larger group gets its own two matmuls; ranks that differ are
separate segments. (A loop over every adapter made 8 one-datum users' pass on the tiny model cost 5.3x one
user's, no gain over 8 passes; one matmul over all adapters' concatenated ranks, masked per row, wasted
G times the LoRA compute, as much on a small model.) Outside a routed pass the layer is PEFT's own
(sampling, the single-adapter reference path).

The adapter's update is computed in the activations' dtype from the adapter's float32 master weights
(cast once per layer and pass: a rank-r matrix, not the activations); on a bf16 base this skips PEFT's
cast of every LoRA input to float32 and back. Gradients reach each adapter from its rows only, so an
adapter trained in mixed passes equals one trained alone (tests/tinker/test_mixed_passes.py).

On a GPU a small pass costs its kernel launches, so a batched segment launches no more than one adapter's
own matmuls would: its products are one autograd function (:class:`_Products`) whose backward writes each
gradient in its tensor's own layout, so each adapter's gradient is its slice of the stacked weights' (left
to autograd, ``x A^T B^T`` made the slices transposed views, copied into gradients of their own: two kernels
per tensor and adapter, half of a shared pass's operators; ``B (A x^T)`` avoided that but made the update a
transposed view, which left the MLP's activations and their gradients in mixed layouts, where the CPU's
elementwise ops ran up to 9x slower: ``silu_backward`` 0.53 ms against 0.06 ms); no layer makes a tensor from
host values (a copy that waits for the device). The usual shared pass, small groups of equal rows and one
scale covering the whole batch (one-datum users), goes further (:class:`_AddProducts`): the base output, the
scale, the cast of the weights (stacked already: each adapter's parameters are views of its slot of the
layer's :class:`~otray.tinker.learner.lora_bank.LoraBank`) and each adapter's gradient are handled inside one
autograd node (on the CPU a layer's autograd nodes for these cost more than its matmuls). A gradient slice keeps its pass's
stacked block alive until every adapter in it has stepped or dropped its gradient. 8 one-datum users' pass:
829 operators, 1.15x one user's (2.7x before the slices; benchmarks/tinker_shared_passes.py, ``kernels``).

A bucketed pass (:mod:`otray.tinker.learner.pass_graphs`) routes by
:class:`~otray.tinker.learner.fixed_rows.FixedRows` instead: one shape and one
code path whatever its adapters, each row's weights gathered from the bank by its slot, so that a CUDA graph can
replay it.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from otray.tinker.learner.fixed_rows import FixedRows, fixed_update
from otray.tinker.learner.lane_gate import LaneGate
from otray.tinker.learner.lora_bank import LoraBank, Stacked

Group = tuple[str, int, int]  # (adapter, first row, row after the last)


def groups_of(adapters: Sequence[str]) -> list[Group]:
    """Runs of equal adapters in row order: ``["a", "a", "b"]`` -> ``[("a", 0, 2), ("b", 2, 3)]``."""
    out: list[Group] = []
    for i, name in enumerate(adapters):
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1], i + 1)
        else:
            out.append((name, i, i + 1))
    return out


SMALL = 4  # groups of at most this many rows are batched (bmm) with other small groups of their rank


@dataclass(frozen=True)
class Segment:
    """Consecutive rows of a routed pass and how a layer adds their adapters' updates: ``zero`` (their
    adapter has no LoRA on this layer), ``own`` (one adapter, its own two matmuls) or ``batched`` (several
    small groups of one rank: two batched matmuls over their stacked weights, rows padded to ``width``;
    ``index``: the rows, padding pointing at a zero row past the segment's end)."""

    kind: str
    start: int
    stop: int
    names: tuple[str, ...]
    width: int = 1
    index: Optional[tuple[int, ...]] = None
    keep: Optional[tuple[int, ...]] = None  # with ``index``: the padded update's rows that are real rows


@dataclass
class Folded:
    """A batched segment's adapters on one layer, as :class:`_AddProducts` takes them: their ``A`` (r, in) and
    ``B`` (out, r) weights, their one scale and, where the layer's :class:`LoraBank` holds them, their rows of it."""

    a: list[torch.nn.Parameter]
    b: list[torch.nn.Parameter]
    scale: float
    bank: Optional[Stacked] = None

    @property
    def k(self) -> int:
        return len(self.a)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, r, in)`` and ``(k, out, r)`` in ``dtype``: the bank's rows (a view when their slots are
        consecutive), else the parameters stacked."""
        a, b = self.bank.weights() if self.bank is not None else (torch.stack(self.a), torch.stack(self.b))
        return a.to(dtype), b.to(dtype)


class RowRouting(threading.local):
    """Which adapter each row of the current pass uses; read by every LoRA layer it was installed on. Each
    thread sees its own pass (a thread-local): two passes of other adapters may run at once. ``gate``: every
    thread's (one object): each LoRA layer of a routed pass is one of its checkpoints (:class:`LaneGate`).
    ``bank``: where the training adapters' weights are stacked (every thread's too)."""

    def __init__(self, gate: Optional[LaneGate] = None, bank: Optional[LoraBank] = None) -> None:
        self.gate = gate or LaneGate()
        self.bank = bank or LoraBank()
        self.groups: Optional[list[Group]] = None
        self.rows = 0
        self.fixed: Optional[FixedRows] = None  # a bucketed pass's routing (:meth:`fixed_rows`)
        self._installed: Optional[list[Any]] = None
        self._key: tuple = ()  # the pass's groups
        # (layer, groups) -> its segments; (layer, adapters) -> their weights, kept from pass to pass while the
        # set of adapters stays (a new set of LoRA layers clears them: :meth:`install`)
        self._plans: dict[tuple, list[Segment]] = {}
        self._folds: dict[tuple, Optional[Folded]] = {}
        self._consts: dict[tuple, torch.Tensor] = {}  # per pass: small index and scale tensors on the device

    def install(self, layers: list[Any]) -> None:
        """Give each LoRA layer in ``layers`` the routed forward (once per layer; a set of layers changes
        when adapters with other target modules are added)."""
        if self._installed is layers:
            return
        self._plans.clear()
        self._folds.clear()
        for m in layers:
            if getattr(m, "_otray_routing", None) is not self and hasattr(m, "lora_A"):
                m.forward = functools.partial(_forward, m, self, type(m).forward.__get__(m))
                m._otray_routing = self
        self._installed = layers

    def layers(self) -> list[Any]:
        """The LoRA layers :meth:`install` gave the routed forward (this thread's)."""
        return self._installed or []

    @contextmanager
    def routed(self, groups: list[Group]) -> Iterator[None]:
        """Route the passes inside to ``groups`` (which must cover the batch's rows in order; small groups
        of one rank next to each other are batched: :func:`row_order` sorts rows so)."""
        self.groups, self.rows, self._key = groups, groups[-1][2] if groups else 0, tuple(groups)
        if len(self._plans) > 4096:  # many different sets of clients: start over
            self._plans.clear()
            self._folds.clear()
        try:
            yield
        finally:
            self.groups, self.rows = None, 0
            self._consts.clear()

    @contextmanager
    def fixed_rows(self, rows: FixedRows) -> Iterator[None]:
        """Route the passes inside by ``rows`` (before any :meth:`routed` groups)."""
        self.fixed = rows
        try:
            yield
        finally:
            self.fixed = None

    def const(self, values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``values`` as a tensor on ``device``, made once per pass: a tensor made from host values in every
        layer is a copy to the device that waits for the device to drain (CUDA), so host and device would take
        turns for the whole pass instead of the host queueing work ahead."""
        key = (values, dtype, device)
        if key not in self._consts:
            self._consts[key] = torch.tensor(values, dtype=dtype).to(device)
        return self._consts[key]

    def folded(self, layer: Any, seg: Segment) -> Optional[Folded]:
        """A batched segment's weights for :class:`_AddProducts` (None when its adapters' scales differ: the
        general path)."""
        key = (id(layer), seg.names, self.bank.version)  # (a bank grown or refilled: its views are stale)
        if key not in self._folds:
            scales = {float(layer.scaling[n]) for n in seg.names}
            a, b = [layer.lora_A[n].weight for n in seg.names], [layer.lora_B[n].weight for n in seg.names]
            self._folds[key] = None if len(scales) != 1 else Folded(a, b, scales.pop(), self.bank.stacked(layer, a, b))
        return self._folds[key]

    def plan(self, layer: Any) -> list[Segment]:
        """The pass's segments for a layer holding the adapters it holds (built once per layer and set of groups)."""
        key = (id(layer), self._key)
        if key not in self._plans:
            groups = self.groups or []
            ranks = tuple(layer.lora_A[n].weight.shape[0] if n in layer.lora_A else 0 for n, _, _ in groups)
            out: list[Segment] = []
            run: list[Group] = []  # small groups of one rank, consecutive
            run_rank = 0

            def flush() -> None:
                if len(run) == 1:
                    out.append(Segment("own", run[0][1], run[0][2], (run[0][0],)))
                elif run:
                    out.append(_batched(run))
                run.clear()

            for (name, start, stop), rank in zip(groups, ranks):
                if run and (stop - start > SMALL or rank != run_rank):
                    flush()
                if rank == 0:
                    out.append(Segment("zero", start, stop, (name,)))
                elif stop - start <= SMALL:
                    run.append((name, start, stop))
                    run_rank = rank
                else:
                    out.append(Segment("own", start, stop, (name,)))
            flush()
            self._plans[key] = out
        return self._plans[key]


def _batched(run: list[Group]) -> Segment:
    width = max(stop - start for _, start, stop in run)
    first, last = run[0][1], run[-1][2]
    pad = last - first  # the zero row appended after the segment's rows
    index = [row - first if row < stop else pad for _, start, stop in run for row in range(start, start + width)]
    names = tuple(n for n, _, _ in run)
    if all(stop - start == width for _, start, stop in run):
        return Segment("batched", first, last, names, width)
    keep = tuple(i for i, at in enumerate(index) if at != pad)
    return Segment("batched", first, last, names, width, tuple(index), keep)


def row_order(sizes: dict[str, int], ranks: dict[str, int], slots: Optional[dict[str, tuple[int, int]]] = None
              ) -> Callable[[str], tuple]:
    """A sort key for a pass's rows by adapter: small groups first, by rank, so that :meth:`RowRouting.plan`
    batches them; then by bank slot (``slots``: :attr:`LoraBank.slots`), so that a batched segment's weights
    are a view of the bank, and by name, so the same clients in another order make the same groups and a
    layer's plan is reused (the fair order of the clients changes from pass to pass: 8 users' cycle 30 ms
    against 27)."""
    slots = slots or {}
    return lambda name: (sizes[name] > SMALL, ranks[name], slots.get(name, (0, -1))[1], name)


def _forward(layer: Any, routing: RowRouting, original: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:
    """A LoRA layer's forward in a routed pass: the base layer on every row, plus each segment's update."""
    if routing.fixed is not None:
        return fixed_update(layer, routing.fixed, layer.base_layer(x, *args, **kwargs), x)
    if routing.groups is None:
        return original(x, *args, **kwargs)
    if layer.merged:
        raise RuntimeError("a routed pass over merged LoRA weights (unmerge first)")
    if x.shape[0] != routing.rows:
        raise RuntimeError(f"routed LoRA layer got {x.shape[0]} rows for a pass of {routing.rows}: this layer does "
                           "not see the batch's rows (a vision tower?); run such requests alone")
    routing.gate.checkpoint()  # the main lane waits here while a side call runs
    result = layer.base_layer(x, *args, **kwargs)
    segments = routing.plan(layer)
    if all(seg.kind == "zero" for seg in segments):
        return result
    if len(segments) == 1 and segments[0].kind == "batched" and segments[0].index is None:  # the usual shared pass
        w = routing.folded(layer, segments[0])
        if w is not None:
            anchor = next((p for p in w.a if p.requires_grad), x)  # the output needs a grad when an adapter trains
            return _gated(routing.gate, _AddProducts.apply(result.reshape(w.k, -1, result.shape[-1]),
                                                           x.reshape(w.k, -1, x.shape[-1]), anchor, w).view(result.shape))
    # a segment of every row takes x whole: a slice's backward is two more kernels a layer
    parts = [_update(layer, routing, seg, x if seg.stop - seg.start == routing.rows else x[seg.start:seg.stop],
                     result.shape[-1]) for seg in segments]
    return _gated(routing.gate, result + (parts[0] if len(parts) == 1 else torch.cat(parts)).to(result.dtype))


def _gated(gate: LaneGate, out: torch.Tensor) -> torch.Tensor:
    """``out`` (a LoRA layer's), whose gradient is a checkpoint of ``gate`` too when a side lane may run: the
    backward of a pass is most of its time (a hook on the gradient, not a node: the graph is unchanged)."""
    if gate.main is not None and out.requires_grad:
        out.register_hook(gate.on_grad)
    return out


def _update(layer: Any, routing: RowRouting, seg: Segment, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """One segment's LoRA update ``scale * B A x``, computed in the activations' dtype."""
    if seg.kind == "zero":
        return x.new_zeros((*x.shape[:-1], out_features))
    if seg.kind == "own":
        name = seg.names[0]
        w_a, w_b = layer.lora_A[name].weight.to(x.dtype), layer.lora_B[name].weight.to(x.dtype)
        return F.linear(F.linear(x, w_a), w_b) * layer.scaling[name]
    k, inner = len(seg.names), x.shape[1:-1]
    if seg.index is not None:  # rows padded to the widest group: padding reads a zero row
        x = torch.cat([x, x.new_zeros((1, *x.shape[1:]))]).index_select(0, routing.const(seg.index, torch.long,
                                                                                           x.device))
    w_a = torch.stack([layer.lora_A[n].weight for n in seg.names]).to(x.dtype)  # (k, r, in)
    w_b = torch.stack([layer.lora_B[n].weight for n in seg.names]).to(x.dtype)  # (k, out, r)
    scales = tuple(float(layer.scaling[n]) for n in seg.names)
    xs = x.reshape(k, -1, x.shape[-1])  # each group's rows (and positions) one after another
    up = _Products.apply(xs, w_a, w_b)  # (k, L, out), each gradient in its tensor's layout
    # one scale for all (the usual case): a Python number, as PEFT scales
    up = up * scales[0] if len(set(scales)) == 1 else up * routing.const(scales, x.dtype, x.device).view(k, 1, 1)
    up = up.reshape(k * seg.width, *inner, out_features)
    if seg.keep is not None:
        up = up.index_select(0, routing.const(seg.keep, torch.long, x.device))
    return up


class _Products(torch.autograd.Function):
    """``(x A^T) B^T`` per group (``x``: (k, L, in), ``A``: (k, r, in), ``B``: (k, out, r)): the update and every
    gradient come out contiguous in their tensors' own layouts, in as many ``bmm`` as autograd's."""

    @staticmethod
    def forward(ctx: Any, xs: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor) -> torch.Tensor:
        h = torch.bmm(xs, w_a.transpose(1, 2))  # (k, L, r)
        ctx.save_for_backward(xs, w_a, w_b, h)
        return torch.bmm(h, w_b.transpose(1, 2))  # (k, L, out)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        xs, w_a, w_b, h = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad
        grad_b = torch.bmm(g.transpose(1, 2), h) if need_b else None  # (k, out, r)
        grad_h = torch.bmm(g, w_b) if need_a or need_x else None  # (k, L, r)
        grad_a = torch.bmm(grad_h.transpose(1, 2), xs) if need_a else None  # (k, r, in)
        grad_x = torch.bmm(grad_h, w_a) if need_x else None  # (k, L, in)
        return grad_x, grad_a, grad_b


class _AddProducts(torch.autograd.Function):
    """``base + s (x A^T) B^T`` per group (``base``: (k, L, out), ``x``: (k, L, in), ``w``: the k adapters' weights):
    the scale and the add ride in the batched matmuls, the weights are stacked (and cast to the activations'
    dtype) inside, and the backward adds each adapter's gradient to its own parameters (its slice of one block,
    in the parameters' dtype), so autograd makes no stack, cast, scale, add or per-parameter nodes for them.
    ``anchor``: a tensor that requires grad when the adapters train (they are not autograd inputs), so the
    output does too. On 8 one-datum users' step of the tiny model: 829 operators against 865, and the CPU's
    cycle 31.7 -> 27.7 ms in-process (``benchmarks/tinker_shared_passes.py``, ``kernels``)."""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, xs: torch.Tensor, anchor: torch.Tensor, w: Folded) -> torch.Tensor:
        w_a, w_b = w.weights(xs.dtype)  # (k, r, in), (k, out, r)
        h = torch.bmm(xs, w_a.transpose(1, 2))  # (k, L, r)
        ctx.save_for_backward(xs, w_a, w_b, h)
        ctx.w = w
        return torch.baddbmm(base, h, w_b.transpose(1, 2), alpha=w.scale)  # (k, L, out)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        xs, w_a, w_b, h = ctx.saved_tensors
        w = ctx.w
        need_base, need_x = ctx.needs_input_grad[:2]
        train = any(p.requires_grad for p in w.a)
        grad_h = torch.bmm(g, w_b).mul_(w.scale) if train or need_x else None  # (k, L, r): scaled while small
        if train:
            _accumulate(w.b, torch.bmm(g.transpose(1, 2), h).mul_(w.scale))  # (k, out, r)
            _accumulate(w.a, torch.bmm(grad_h.transpose(1, 2), xs))  # (k, r, in)
        grad_x = torch.bmm(grad_h, w_a) if need_x else None  # (k, L, in)
        return (g if need_base else None), grad_x, None, None


def _accumulate(params: list[torch.nn.Parameter], block: torch.Tensor) -> None:
    """Each parameter's gradient += its slice of ``block`` (cast to its dtype; a first gradient is the slice
    itself, no copy)."""
    for p, grad in zip(params, block.to(params[0].dtype).unbind(0)):
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)
