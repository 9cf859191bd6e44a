"""Running a checked custom loss (:class:`~otray.tinker.learner.loss_graph.LossGraph`) on the learner.

:func:`run_graph` evaluates one datum's loss node by node: each ``call_function`` node's allow-listed
name is looked up in ``torch``, ``math`` or ``operator`` (never imported from the request), each
``call_method`` node calls an allow-listed method of a tensor. Before a node runs, its operands are
held to the datum's element budget and checked where the allow-list cannot be (Python values,
``gather`` indices, Python-list indices); after it, the elements the nodes made so far are counted against
the same budget and a Python integer it made is held within ``MAX_INT``. A call's runs share one
:class:`GraphClock`: past its ``call_s`` learner seconds (``custom_losses.max_call_s``) the call fails as
the user's error, so a loss cheap per node but run over many nodes and datums cannot keep the learner.
:func:`surrogate` turns a micro-batch's losses into per-token surrogate losses that carry their
gradient into the model in one backward pass.

Runs in the SharedLearner actor (and its reductions in the TinkerService, for a call's answer)."""

from __future__ import annotations

import builtins
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

from otray.tinker.learner.loss_graph import ELEMENT_FACTOR, ELEMENT_SLACK, MAX_INT, LossGraph, LossNode
from otray.tinker.errors import UserError


@dataclass
class GraphClock:
    """One call's custom-loss seconds on the learner so far (every slice of the call adds to it), against
    ``limit_s`` (``custom_losses.max_call_s``)."""

    limit_s: float
    spent_s: float = 0.0

    def check(self, started: float, where: str) -> None:
        """Raise the user's error when this run (begun at ``started``, ``time.monotonic``) takes the call
        past its limit."""
        if self.spent_s + time.monotonic() - started > self.limit_s:
            raise UserError(f"{where}: this call's custom loss ran past its budget of {self.limit_s:g} learner "
                            "seconds (custom_losses.max_call_s); send fewer datums per call or a smaller loss")


def _resolve(name: str) -> Callable[..., Any]:
    """An allow-listed function name -> the function (only ever called with names in FUNCTIONS)."""
    import torch

    root, *path = name.split(".")
    obj: Any = {"torch": torch, "math": math, "operator": operator}[root]
    for part in path:
        obj = getattr(obj, part)
    return obj


def run_graph(g: LossGraph, values: list[Any], device: Any, started: float | None = None) -> tuple[Any, dict[str, Any]]:
    """One datum's ``(loss, metrics)``: ``values`` are ``logprobs`` then the loss's inputs, as tensors on
    ``device``. A failing node or an over-budget one raises :class:`UserError` naming it (``g.clock``, if
    set: the call's clock, this run begun at ``started``)."""
    import torch

    started = time.monotonic() if started is None else started

    env: dict[str, Any] = {}
    budget = ELEMENT_FACTOR * sum(v.numel() for v in values) + ELEMENT_SLACK
    made = 0  # elements of the tensors the nodes made so far

    def decode(v: Any) -> Any:
        if isinstance(v, list):
            return [decode(x) for x in v]
        if not isinstance(v, dict):
            return v
        (kind, x), = v.items()
        if kind == "ref":
            return env[x]
        if kind == "tuple":
            return tuple(decode(x))
        if kind == "dict":
            return {k: decode(a) for k, a in x.items()}
        if kind == "slice":
            return slice(*decode(x))
        if kind == "float":
            return float(x)
        if kind == "dtype":
            return getattr(torch, x)
        if kind == "device":
            return device  # the learner's device, wherever the client traced it
        if kind == "layout":
            return torch.strided
        if kind == "memory_format":
            return getattr(torch, x)
        return Ellipsis

    for node in g.nodes:
        at = f"custom loss {g.name!r}, node {node.name!r} ({node.target})"
        if node.op == "placeholder":
            env[node.name] = values[len(env)]
            continue
        args, kwargs = [decode(a) for a in node.args], {k: decode(v) for k, v in node.kwargs}
        if node.op == "output":
            return _result(g.name, *args[0])
        if g.clock is not None:
            g.clock.check(started, at)
        _within_budget(node, args, kwargs, budget, at)
        _safe_operands(node, args, kwargs, at)
        try:
            if node.op == "call_method":
                if not isinstance(args[0], torch.Tensor):
                    raise UserError(f"{at}: calls a method of a {type(args[0]).__name__}, not of a tensor")
                env[node.name] = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.target.endswith("getattr"):
                env[node.name] = builtins.getattr(args[0], args[1])
            else:
                env[node.name] = _resolve(node.target)(*args, **kwargs)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's graph failed on this datum: theirs to fix
            raise UserError(f"{at} failed: {str(e).strip().splitlines()[0][:300]}") from None
        result = env[node.name]
        if isinstance(result, int) and not isinstance(result, bool) and abs(result) > MAX_INT:
            raise UserError(f"{at}: makes a Python integer past 2**63 (they grow without bound); compute on tensors")
        made += _elements(result)
        if made > budget:
            raise UserError(f"{at}: the loss's tensors reach {made} elements, over this datum's budget of {budget} "
                            f"({ELEMENT_FACTOR}x its inputs + {ELEMENT_SLACK}); use fewer steps on whole sequences")
    raise UserError(f"custom loss {g.name!r} has no output")  # parse_graph makes this unreachable


def _result(name: str, loss: Any, metrics: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch

    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        raise UserError(f"custom loss {name!r} must return a scalar float tensor as its loss, got "
                        f"{getattr(loss, 'shape', type(loss).__name__)}")
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise UserError(f"custom loss {name!r}: metric {key!r} must be a one-element tensor")
    return loss, metrics


def _safe_operands(node: LossNode, args: list[Any], kwargs: dict[str, Any], at: str) -> None:
    """What the allow-list alone cannot rule out: Python operators on strings or lists (``"a" * 10**12``),
    integer powers of Python ints (unbounded big integers) and ``gather`` indices out of range (on a GPU an
    out-of-range index is a device-side assert that would end the learner every user shares)."""
    import torch

    if node.target.startswith(("operator.", "math.")) and node.target != "operator.getitem":
        if any(not isinstance(a, (torch.Tensor, int, float, bool)) for a in (*args, *kwargs.values())):
            raise UserError(f"{at}: operands must be tensors or numbers")
        if node.target in ("operator.pow", "math.pow") and not any(isinstance(a, torch.Tensor) for a in args):
            args[:] = [float(a) for a in args]
    if node.target in ("torch.gather", "gather"):
        src, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
        index = args[2] if len(args) > 2 else kwargs.get("index")
        if not (isinstance(src, torch.Tensor) and isinstance(index, torch.Tensor) and isinstance(dim, int)):
            raise UserError(f"{at}: gather(input, dim, index) needs tensors and an int dim")
        if not -src.ndim <= dim < src.ndim:
            raise UserError(f"{at}: gather's dim {dim} is out of range for a {src.ndim}-d input")
        if index.dtype != torch.int64 or index.numel() and (int(index.min()) < 0 or int(index.max()) >= src.shape[dim]):
            raise UserError(f"{at}: gather's index must be int64 within [0, {src.shape[dim]})")


def _elements(value: Any) -> int:
    """Tensor elements in a node's result (a tensor, or a tuple of them such as ``max(dim=...)``'s)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel()
    return sum(_elements(v) for v in value) if isinstance(value, (tuple, list)) else 0


def _within_budget(node: LossNode, args: list[Any], kwargs: dict[str, Any], budget: int, at: str) -> None:
    """Refuse a node whose tensor operands (broadcast together, or in total) or an integer-tensor
    index would exceed ``budget`` elements."""
    import torch

    tensors: list[Any] = []

    def collect(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)

    collect(args)
    collect(list(kwargs.values()))
    if node.target == "operator.getitem" and len(args) == 2:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype != torch.bool for i in index):
            raise UserError(f"{at}: indexes with an integer tensor; use a boolean mask or torch.gather")
        if isinstance(args[0], torch.Tensor) and any(isinstance(i, (list, tuple)) for i in index):
            raise UserError(f"{at}: indexes a tensor with a list (an integer index of each element, unchecked on a "
                            "GPU); use a boolean mask or torch.gather")
    total = sum(t.numel() for t in tensors)
    try:
        broadcast = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors))) if len(tensors) > 1 else 0
    except RuntimeError:
        broadcast = 0  # not broadcast together (cat, gather): the total bounds the result
    if max(total, broadcast) > budget:
        raise UserError(f"{at}: touches {max(total, broadcast)} elements, over this datum's budget of {budget} "
                        f"({ELEMENT_FACTOR}x its inputs + {ELEMENT_SLACK}); outer products and repeats are not served")


def surrogate(g: LossGraph, batch: list[Any], lp: Any, device: Any) -> tuple[Any, float, dict[str, float]]:
    """A micro-batch's custom loss as per-token surrogate losses with its gradient: the graph runs on a
    detached copy of each row's logprobs (``lp``: ``(rows, T)`` or ``(rows, T, K)``), ``w = d loss / d
    logprobs``, and the surrogate ``w * lp`` (summed over K) back-propagates exactly the custom loss's
    gradient into the model -- the chain rule the SDK's client-side path applies through a second request,
    here in one pass. Returns the surrogate ``(rows, T)``, the losses' sum and the metrics' per-datum sums."""
    import torch

    leaf = lp.detach().requires_grad_(True)
    sums: dict[str, float] = {}
    started = time.monotonic()
    try:
        with torch.enable_grad():
            losses = []
            for i, d in enumerate(batch):
                values = [leaf[i, :len(d)], *(torch.as_tensor(a, device=device) for a in d.custom_inputs)]
                loss, metrics = run_graph(g, values, device, started)
                losses.append(loss.float())
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value.detach().float())
            total = torch.stack(losses).sum()
            grad = torch.autograd.grad(total, leaf, allow_unused=True)[0] if total.requires_grad else None
        if g.clock is not None:
            g.clock.check(started, f"custom loss {g.name!r}")
    finally:
        if g.clock is not None:
            g.clock.spent_s += time.monotonic() - started
    weights = torch.zeros_like(lp) if grad is None else grad.detach()
    tok = weights * lp
    return (tok.sum(-1) if tok.ndim == 3 else tok), float(total.detach()), sums


def add_sums(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two sets of summed metrics, added key by key (micro-batches and slices of one call)."""
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in {*a, *b}}


def reduced(sums: dict[str, float], n: int) -> dict[str, float]:
    """Metric sums over ``n`` datums as Tinker reports them: ``:mean`` keys divided by ``n``."""
    return {key: value / n if key.endswith(":mean") else value for key, value in sums.items()}
