"""Server-side custom losses: the SDK's traced loss graph, checked against an allow-list and
interpreted here, never executed as code.

``ServiceClient.create_custom_loss(fn, input_ranks)`` traces ``fn(logprobs, *inputs) -> (loss,
metrics)`` with ``torch.fx`` and, when the service's client config says
``custom_loss_server_side``, uploads it as plain data (``CustomLossGraph``: nodes in execution
order, each an op, a target name and encoded arguments). :func:`parse_graph` turns that JSON into
a :class:`LossGraph` or refuses it with a :class:`~otray.tinker.wire.messages.UserError` naming the node;
:func:`~otray.tinker.learner.loss_run.run_graph` evaluates one datum's loss by walking the nodes and calling,
for each, the function the allow-list maps its *name* to. Nothing the user sent is imported, looked up as an
attribute of anything but a tensor method on the allow-list, or evaluated.

What is allowed: elementwise math, comparisons and reductions on tensors (``torch.*``, tensor
methods, ``torch.nn.functional`` losses and activations, ``operator``'s arithmetic, ``math``'s
scalar functions), views and reshapes, ``cat``/``stack``/``gather``, ``*_like`` factories and
indexing by ints, slices or boolean masks. What is not: anything that takes a size (``zeros``,
``arange``, ``repeat``, ``expand``), matrix products, integer-tensor indexing, random numbers,
in-place methods and ``out=`` arguments, modules and captured tensors. Each datum's run is held to an
element budget (``ELEMENT_FACTOR`` times its inputs' elements, plus ``ELEMENT_SLACK``): a node's
operands (broadcast together, or in total) are checked before it runs, and the tensors the nodes made
so far (which autograd keeps for the backward pass) are counted after each, so a loss cannot make the
shared learner hold more than a fixed multiple of its own inputs. What a loss may cost in all is an admin's
:class:`~otray.tinker.config.CustomLossLimits` (``custom_losses``): nodes, the graph's bytes and the numbers written
into it (checked here), Python integers within ``MAX_INT``, devices never named (``to("meta")``), Python-list
indices refused like integer tensors, and the learner seconds of one call (``call_s``, checked as it runs).

Runs in the TinkerService actor (checking an uploaded graph) and in the SharedLearner (reading it before it runs)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from otray.tinker.config import CustomLossLimits
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import GraphUpload

MAX_INT = 2 ** 63  # a Python integer in a graph (written in it, or made by its nodes) stays within +-2**63
MAX_INPUTS = 16  # logprobs included, as the SDK limits it
ELEMENT_FACTOR, ELEMENT_SLACK = 64, 1 << 20  # a datum's loss may make 64x its input elements + 1Mi in all
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")

_ELEMENTWISE = """abs neg exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sigmoid tanh relu sign square
    reciprocal floor ceil round trunc clamp clip clamp_min clamp_max minimum maximum where pow lerp isnan isinf
    isfinite nan_to_num logical_and logical_or logical_not logical_xor eq ne lt le gt ge add sub mul div
    true_divide masked_fill logaddexp xlogy"""
_REDUCTIONS = """sum mean nansum nanmean prod amax amin max min logsumexp std var norm all any count_nonzero
    cumsum argmax argmin softmax log_softmax"""
_SHAPES = "reshape flatten squeeze unsqueeze transpose permute narrow select gather cat concat stack flip"
TORCH_FUNCTIONS = frozenset(f"torch.{n}" for n in f"{_ELEMENTWISE} {_REDUCTIONS} {_SHAPES} zeros_like ones_like "
                            "full_like tensor scalar_tensor".split())
FUNCTIONAL = frozenset(f"torch.nn.functional.{n}" for n in """log_softmax softmax relu sigmoid silu tanh kl_div
    mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy_with_logits normalize""".split()) | {
    "torch._C._nn.log_sigmoid", "torch._C._nn.softplus", "torch._C._nn.gelu"}  # F.logsigmoid, F.softplus, F.gelu
OPERATORS = frozenset(f"operator.{n}" for n in "add sub mul truediv floordiv mod pow neg pos abs getitem lt le gt "
                      "ge eq ne and_ or_ xor invert".split())
MATH = frozenset(f"math.{n}" for n in "log exp sqrt log1p expm1 pow fabs floor ceil tanh isfinite isnan".split())
FUNCTIONS = TORCH_FUNCTIONS | FUNCTIONAL | OPERATORS | MATH
METHODS = frozenset(f"{_ELEMENTWISE} {_REDUCTIONS} {_SHAPES} view view_as reshape_as expand_as t contiguous clone "
                    "detach float double long int bool to type_as size dim numel chunk split unbind".split()
                    ) - {"cat", "concat", "stack"}
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "T", "values", "indices"})
_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})
_CONSTANTS = {"layout": frozenset({"strided"}), "memory_format": frozenset({"contiguous_format", "preserve_format"})}


@dataclass(frozen=True)
class LossNode:
    """One node as the SDK sent it (``args``/``kwargs`` still in its JSON encoding, checked)."""

    op: str
    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class LossGraph:
    """A checked custom loss: its name, its inputs (``logprobs`` first) with their ranks, its nodes."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[LossNode, ...]
    call_s: float = CustomLossLimits.max_call_s  # learner seconds one call's runs may take (all its slices)
    clock: Optional[Any] = field(default=None, compare=False)  # a call's :class:`~otray.tinker.learner.loss_run.GraphClock` (set per call)

    @property
    def datum_cost(self) -> int:
        """Tokens a datum's run of this loss is charged as, on top of its own (one per node: a node's run on
        a datum costs about what a token of the pass does, on the CPU), when calls are sliced and shared."""
        return len(self.nodes)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads after ``logprobs``, in its order."""
        return tuple(name for name, _ in self.inputs[1:])

    def rank(self, name: str) -> int:
        return dict(self.inputs)[name]


def parse_graph(req: GraphUpload, limits: Optional[CustomLossLimits] = None) -> LossGraph:
    """A ``create_custom_loss`` upload's ``name``, ``inputs`` and ``graph`` -> :class:`LossGraph`, every
    node checked against the allow-list and the graph against ``limits`` (default: the defaults);
    anything else is a :class:`UserError` naming it."""
    try:
        return _parse(req, limits or CustomLossLimits())
    except RecursionError:
        raise UserError("custom loss: an argument nests too deeply; send it with ServiceClient.create_custom_loss") from None


def _parse(req: GraphUpload, limits: CustomLossLimits) -> LossGraph:
    name = str(req.name or "loss")[:200]
    where = f"custom loss {name!r}"
    graph = req.graph
    if not isinstance(graph, dict) or graph.get("format", 1) != 1 or not isinstance(graph.get("nodes"), list):
        raise UserError(f"{where}: graph must be a CustomLossGraph (format 1, a list of nodes); send it with "
                        "ServiceClient.create_custom_loss")
    size = len(json.dumps(graph))
    if size > limits.max_graph_bytes:
        raise UserError(f"{where}: the graph takes {size} bytes as JSON; at most {limits.max_graph_bytes} are "
                        "served (custom_losses.max_graph_bytes)")
    inputs = _inputs(req.inputs, where)
    raw = graph["nodes"]
    if not 0 < len(raw) <= limits.max_nodes:
        raise UserError(f"{where}: the graph has {len(raw)} nodes; at most {limits.max_nodes} are served "
                        "(custom_losses.max_nodes)")
    numbers = [0]  # the numbers written into the graph so far
    nodes, seen = [], set()
    for i, n in enumerate(raw):
        node = _node(n, i, where)
        at = f"{where}, node {node.name!r}"
        if node.name in seen:
            raise UserError(f"{at}: the name is used twice")
        if (node.op == "placeholder") != (i < len(inputs)):
            raise UserError(f"{at}: the graph's first {len(inputs)} nodes must be its inputs' placeholders, "
                            "and only they")
        if node.op == "placeholder" and node.target != inputs[i][0]:
            raise UserError(f"{at}: placeholder {node.target!r} is not input {inputs[i][0]!r}")
        if (node.op == "output") != (i == len(raw) - 1):
            raise UserError(f"{at}: the graph must end with its one output node")
        _check_target(node, at)
        for value in (*node.args, *(v for _, v in node.kwargs)):
            _check_value(value, seen, at, numbers)
        if numbers[0] > limits.max_literal_numbers:
            raise UserError(f"{at}: the graph writes more than {limits.max_literal_numbers} numbers into its "
                            "constants (custom_losses.max_literal_numbers); send large constants as loss_fn_inputs")
        _check_device_args(node, at)
        seen.add(node.name)
        nodes.append(node)
    _check_output(nodes[-1], where)
    return LossGraph(name, inputs, tuple(nodes), limits.max_call_s)


def _inputs(raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_INPUTS:
        raise UserError(f"{where}: inputs must list 1 to {MAX_INPUTS} inputs, logprobs first")
    out = []
    for x in raw:
        ok = isinstance(x, dict) and isinstance(x.get("name"), str) and INPUT_NAME.fullmatch(x["name"])
        if not ok or x.get("rank") not in (0, 1, 2) or isinstance(x.get("rank"), bool):
            raise UserError(f"{where}: input {x!r} must be {{name: lowercase name, rank: 0, 1 or 2}}")
        out.append((x["name"], int(x["rank"])))
    names = [n for n, _ in out]
    if names[0] != "logprobs" or out[0][1] == 0 or len(set(names)) != len(names) or "target_tokens" in names:
        raise UserError(f"{where}: inputs must start with logprobs (rank 1 or 2), then distinct loss_fn_inputs keys "
                        f"other than target_tokens; got {names}")
    return tuple(out)


def _node(n: Any, i: int, where: str) -> LossNode:
    ops = ("placeholder", "call_function", "call_method", "output")
    if not isinstance(n, dict) or not all(isinstance(n.get(k), str) for k in ("op", "name", "target")):
        raise UserError(f"{where}: node {i} is not a CustomLossNode (op, name, target, args, kwargs)")
    if n["op"] not in ops:
        raise UserError(f"{where}: node {n['name']!r} is a {n['op']} node; a custom loss may not use modules or "
                        "captured tensors (allowed: " + ", ".join(ops) + ")")
    args, kwargs = n.get("args", []), n.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise UserError(f"{where}: node {n['name']!r} has malformed args or kwargs")
    if "out" in kwargs:
        raise UserError(f"{where}: node {n['name']!r} writes into a tensor (out=); return new tensors instead")
    return LossNode(n["op"], n["name"], n["target"], tuple(args), tuple(sorted(kwargs.items())))


def _check_target(node: LossNode, at: str) -> None:
    if node.op == "call_function" and node.target not in FUNCTIONS and node.target not in ("getattr", "builtins.getattr"):
        raise UserError(f"{at}: {node.target} is not on this service's list of operations a custom loss may call "
                        "(elementwise math, reductions, views, torch.nn.functional losses; no sizes, matrix "
                        "products or random numbers); run it client-side with a plain function instead")
    if node.op == "call_function" and node.target.endswith("getattr") and (
            len(node.args) != 2 or node.args[1] not in ATTRIBUTES):
        raise UserError(f"{at}: reads an attribute other than {', '.join(sorted(ATTRIBUTES))}")
    if node.op == "call_method" and node.target not in METHODS:
        raise UserError(f"{at}: tensor method {node.target!r} is not on this service's list (in-place methods, "
                        "sizes and host copies are not); run the loss client-side instead")


def _check_value(v: Any, seen: set[str], at: str, numbers: list[int]) -> None:
    """An encoded argument: JSON scalars and lists, or one of the SDK's one-key objects (``numbers[0]``:
    the numbers met so far, counted)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{at}: a non-finite number must come as {{'float': 'inf'}}")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            raise UserError(f"{at}: an integer past 2**63 is not served (Python integers grow without bound)")
        if isinstance(v, str) and len(v) > 64:
            raise UserError(f"{at}: a string of {len(v)} characters; at most 64 are served")
        numbers[0] += isinstance(v, (int, float)) and not isinstance(v, bool)
        return
    if isinstance(v, list):
        for x in v:
            _check_value(x, seen, at, numbers)
        return
    if not isinstance(v, dict) or len(v) != 1:
        raise UserError(f"{at}: an argument {str(v)[:80]} is not in the SDK's encoding")
    (kind, x), = v.items()
    if kind == "ref":
        if x not in seen:
            raise UserError(f"{at}: refers to {x!r}, which is not an earlier node")
    elif kind in ("tuple", "slice"):
        if not isinstance(x, list) or (kind == "slice" and len(x) != 3):
            raise UserError(f"{at}: a malformed {kind}")
        _check_value(x, seen, at, numbers)
    elif kind == "dict":
        if not isinstance(x, dict):
            raise UserError(f"{at}: a malformed dict")
        _check_value(list(x.values()), seen, at, numbers)
    elif kind == "float":
        if x not in ("inf", "-inf", "nan"):
            raise UserError(f"{at}: float {x!r} is not inf, -inf or nan")
    elif kind == "dtype":
        if x not in _DTYPES:
            raise UserError(f"{at}: dtype {x!r} is not one of {sorted(_DTYPES)}")
    elif kind == "device":
        if not isinstance(x, str):
            raise UserError(f"{at}: a malformed device")
    elif kind in _CONSTANTS:
        if x not in _CONSTANTS[kind]:
            raise UserError(f"{at}: {kind} {x!r} is not one of {sorted(_CONSTANTS[kind])}")
    elif kind != "ellipsis":
        raise UserError(f"{at}: an argument of kind {kind!r} is not in the SDK's encoding")


def _check_device_args(node: LossNode, at: str) -> None:
    """Devices are never named: the loss runs where the learner is (``{"device": ...}`` arguments stand for
    it). A string where ``to`` / ``type`` take a dtype or device, or as any ``device=``, is refused."""
    named = [v for k, v in node.kwargs if k == "device" and isinstance(v, str)]
    if node.op == "call_method" and node.target in ("to", "type"):
        named += [v for v in node.args[1:] if isinstance(v, str)]
        named += [v for k, v in node.kwargs if k in ("dtype", "tensor_type") and isinstance(v, str)]
    if named:
        raise UserError(f"{at}: names a device or tensor type ({named[0]!r}); a custom loss runs on the learner's "
                        "device: pass a dtype (torch.float32, ...) or nothing")


def _check_output(node: LossNode, where: str) -> None:
    out = node.args[0] if len(node.args) == 1 else None
    parts = out.get("tuple") if isinstance(out, dict) else out
    ok = isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], dict) and "ref" in parts[0]
    metrics = parts[1].get("dict") if ok and isinstance(parts[1], dict) else None
    if not ok or not isinstance(metrics, dict):
        raise UserError(f"{where}: the output must be (loss, metrics): a tensor and a dict of tensors")
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key) or not (isinstance(value, dict) and "ref" in value):
            raise UserError(f"{where}: metric {key!r} must be a tensor named custom/<name>:sum or custom/<name>:mean")
