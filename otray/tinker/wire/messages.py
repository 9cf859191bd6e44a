"""The Tinker SDK's wire formats, in and out: protobuf for forward_backward requests and for
forward_backward and sample results (the schema ships in the ``tinker`` wheel:
``tinker.proto.tinker_public_pb2``), and the checks every request gets before it reaches a
learner.

A request the service cannot use raises :class:`UserError` with a message that says what is
wrong and what to send instead; the service turns it into a 4xx or a ``user``-category
failed future, never a 5xx.

Tinker's datum -> otray's :class:`~otray.types.Datum`: ``model_input`` (token chunks) is the
input row, ``loss_fn_inputs['target_tokens']`` its targets, ``weights`` the cross-entropy
weights, ``logprobs`` / ``advantages`` the sampler's logprobs and the advantages of the policy
losses. Every tensor has one entry per input token.

Runs in the gateway's Serve replica (request fields checked at the route) and the TinkerService actor (a training call's protobuf decoded, its answer encoded)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from otray.tinker.errors import UserError
from otray.tinker.wire.images import image_tokens
from otray.types import Datum
from otray.vision import Image, ImageError

LOSSES: dict[str, tuple[str, ...]] = {  # loss -> the loss_fn_inputs it needs besides target_tokens
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
    # the sampler's logprobs come from the recordings its provenance names (otray.tinker.service.stability)
    "stable_reinforce": ("advantages",),
}
_CLIPS = {"clip_low_threshold": "clip_low", "clip_high_threshold": "clip_high"}
# Tinker's loss_fn_config keys -> otray.algos.losses's
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "ppo": _CLIPS,
    "cispo": _CLIPS,
    "gspo": _CLIPS,
    "dro": {"beta": "beta"},
    "stable_reinforce": {"clip_high_threshold": "clip_high", "kl_coeff": "kl_coeff"},
}
# per-token loss_fn_inputs only some losses read: sent to another loss they are refused, not ignored
TOKEN_INPUTS: dict[str, tuple[str, ...]] = {
    "clip_low_threshold": ("ppo", "cispo", "gspo"),
    "clip_high_threshold": ("ppo", "cispo", "gspo", "stable_reinforce"),
    "sequence_ratio_mask": ("gspo",),
}
MAX_TOKENS_PER_DATUM = 1 << 20
MAX_K = 1024  # the widest (N, K) target_tokens / weights (top-K distillation sends K ~ 20)


# the JSON fields the service reads, and their types: checked at the route, before any reaches SQLite,
# a dict lookup or a string method (a list as model_id used to be a 500); ints are within SQLite's range
REQUEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(("model_id", "session_id", "sampling_session_id", "request_id", "tinker_path", "path",
                     "model_path", "base_model", "name", "loss_fn", "source_path", "destination_project_id", "kind"),
                    str),
    **dict.fromkeys(("seq_id", "model_seq_id", "sampling_session_seq_id", "num_samples",
                     "prompt_logprobs_last_n", "custom_loss_seq_id"), int),
    **dict.fromkeys(("lora_config", "sampling_params", "prompt", "adam_params", "optim_params",
                     "optimizer_config", "user_metadata", "graph"), dict),
    "inputs": list,
    **dict.fromkeys(("prompt_logprobs", "overwrite", "optimizer", "record_stability_info"), bool),
    "ttl_seconds": (int, float),
}
_INT_RANGE = (-(1 << 63), (1 << 63) - 1)


def check_request_fields(data: dict[str, Any]) -> None:
    """Each field of :data:`REQUEST_FIELDS` present in ``data`` has its type (null = absent), or a
    :class:`UserError` naming the field, what it must be and what came."""
    for key, want in REQUEST_FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        kinds = want if isinstance(want, tuple) else (want,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join({str: "a string", int: "an integer", float: "a number", dict: "an object",
                                 bool: "true or false", list: "a list"}[k] for k in kinds)
            raise UserError(f"{key} must be {names}, got {json.dumps(value)[:80]}")
        if isinstance(value, int) and not isinstance(value, bool) and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise UserError(f"{key}={value} is out of range")
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key} must be a finite number, got {value}")


def pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise RuntimeError("the Tinker API needs the tinker package (pip install 'otray[tinker]')") from e
    return tinker_public_pb2


@dataclass(frozen=True)
class Span:
    """One provenance run of a datum: ``length`` positions that are ``[offset, offset + length)`` of
    sequence ``sequence_id``'s prompt (``kind`` ``prompt_tokens``) or sampled tokens (``sampled_tokens``)."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class DatumSpans:
    """A datum's provenance: runs tiling its ``model_input`` and its ``target_tokens``."""

    model_input: list[Span]
    targets: list[Span]


@dataclass
class TrainCall:
    """A decoded ``/forward_backward`` body (also ``forward``: ``forward_only``). ``spans``: each
    datum's provenance, None where it has none (stable_reinforce needs it on every datum)."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    datums: list[Datum]
    spans: list[Optional[DatumSpans]]
    graph: Any = None  # a custom loss's LossGraph (otray.tinker.learner.loss_graph)


def _tensor(msg: Any, name: str, where: str, n: int) -> np.ndarray:
    """One ``loss_fn_inputs`` tensor as a 1-D or 2-D array: dense, or sparse CSR (the SDK sends a 2-D
    ``target_tokens`` / ``weights`` so when that is smaller) densified with zeros."""
    p = pb()
    dtypes = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise UserError(f"{where}: loss_fn_inputs[{name!r}] has dtype {msg.dtype}; send float32 or int64")
    dtype, shape = np.dtype(dtypes[msg.dtype]), list(msg.shape)
    if len(shape) > 2 or any(d < 0 for d in shape) or (len(shape) == 2 and (shape[1] > MAX_K or shape[0] != n)):
        raise UserError(f"{where}: loss_fn_inputs[{name!r}] has shape {shape}; send (N,) or (N, K) with K <= {MAX_K}, "
                        f"N = {n} (one row per input token)")
    if msg.HasField("sparse_csr"):
        return _densified(msg.sparse_csr, dtype, shape, f"{where}: loss_fn_inputs[{name!r}]")
    if len(msg.dense) % dtype.itemsize:
        raise UserError(f"{where}: loss_fn_inputs[{name!r}] has {len(msg.dense)} bytes, not a whole number of values")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != arr.size:
        raise UserError(f"{where}: loss_fn_inputs[{name!r}] has shape {shape} for {arr.size} values")
    arr = arr.reshape(shape) if len(shape) == 2 else arr
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise UserError(f"{where}: loss_fn_inputs[{name!r}] holds NaN or infinite values")
    return arr


def _densified(csr: Any, dtype: np.dtype, shape: list[int], what: str) -> np.ndarray:
    """A sparse CSR tensor (values, int64 row pointers and column indices) as a dense 2-D array."""
    if len(shape) != 2:
        raise UserError(f"{what} is sparse but its shape is {shape}; a sparse tensor is (N, K)")
    rows, cols = shape
    try:
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
    except ValueError:
        raise UserError(f"{what}: its sparse buffers are not whole numbers of values") from None
    ok = (len(crow) == rows + 1 and crow[0] == 0 and np.all(np.diff(crow) >= 0) and crow[-1] == len(values) == len(col)
          and (len(col) == 0 or (col.min() >= 0 and col.max() < cols)))
    if not ok:
        raise UserError(f"{what}: a malformed sparse CSR tensor (row pointers, column indices and values disagree "
                        f"with shape {shape}); send it with the tinker SDK's TensorData")
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise UserError(f"{what} holds NaN or infinite values")
    out = np.zeros((rows, cols), dtype=dtype)
    out[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return out


def _model_input(msg: Any, where: str, limits: Any) -> tuple[list[int], list[Any]]:
    """A datum's ``model_input`` chunks -> its token ids (an image's expanded tokens included) and images."""
    tokens: list[int] = []
    images: list[Any] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk") if chunk.DESCRIPTOR.oneofs else None
        if kind == "image":
            expected = chunk.image.expected_tokens if chunk.image.HasField("expected_tokens") else None
            try:
                images.append(Image.from_bytes(chunk.image.data))
                tokens.extend(image_tokens(images[-1], chunk.image.format, expected, limits.vision))
            except ImageError as e:
                raise UserError(f"{where}: {e}") from None
            continue
        if not chunk.HasField("encoded_text") or kind not in (None, "encoded_text"):
            raise UserError(f"{where}: model_input holds a {kind or 'non-text'} chunk; this service trains on token "
                            "and image chunks")
        if len(chunk.encoded_text.tokens) % 4:
            raise UserError(f"{where}: a token chunk is not a whole number of int32 values")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    n = len(tokens)
    if n == 0 or n > MAX_TOKENS_PER_DATUM:
        raise UserError(f"{where}: model_input has {n} tokens; send 1 to {MAX_TOKENS_PER_DATUM}")
    if min(tokens) < 0 or max(tokens) >= limits.vocab:
        raise UserError(f"{where}: model_input holds a token id outside the model's vocabulary [0, {limits.vocab})")
    return tokens, images


def _custom_datum(msg: Any, graph: Any, where: str, limits: Any) -> Datum:
    """A datum for a custom loss (:class:`~otray.tinker.learner.loss_graph.LossGraph`): ``target_tokens`` (1-D, or
    (N, K) when the loss takes rank-2 logprobs) and each input the loss declares, at its declared rank."""
    tokens, images = _model_input(msg, where, limits)
    n, keys = len(tokens), ("target_tokens", *graph.input_names)
    extra = sorted(set(msg.loss_fn_inputs) - set(keys))
    if extra:
        raise UserError(f"{where}: custom loss {graph.name!r} does not read loss_fn_inputs {extra}; it reads {list(keys)}")
    arrays = []
    for key, rank in (("target_tokens", graph.rank("logprobs")), *graph.inputs[1:]):
        if key not in msg.loss_fn_inputs:
            raise UserError(f"{where}: custom loss {graph.name!r} needs loss_fn_inputs[{key!r}]")
        arr = _tensor(msg.loss_fn_inputs[key], key, where, n)
        arr = arr.reshape(()) if rank == 0 and list(msg.loss_fn_inputs[key].shape) == [] and arr.size == 1 else arr
        if arr.ndim != rank or (rank and len(arr) != n):
            raise UserError(f"{where}: loss_fn_inputs[{key!r}] has shape {list(arr.shape)}; custom loss {graph.name!r} "
                            f"declared rank {rank} ({['a scalar', f'[{n}]', f'[{n}, K]'][rank]})")
        arrays.append(arr)
    targets = arrays[0].astype(np.int64)
    if targets.min() < 0 or targets.max() >= limits.vocab:
        raise UserError(f"{where}: target_tokens holds a token id outside the model's vocabulary [0, {limits.vocab})")
    ones, zeros = [1.0] * n, [0.0] * n
    wide = targets.tolist() if targets.ndim == 2 else None
    return Datum(tokens, [r[0] for r in wide] if wide else targets.tolist(), ones, zeros, zeros,
                 target_k=wide, weights_k=[[0.0] * targets.shape[1]] * n if wide else None, images=tuple(images),
                 custom_inputs=tuple(arrays[1:]))


def _datum(msg: Any, loss_fn: str, where: str, limits: Any) -> Datum:
    tokens, images = _model_input(msg, where, limits)
    n, vocab = len(tokens), limits.vocab
    inputs = {name: _tensor(msg.loss_fn_inputs[name], name, where, n) for name in msg.loss_fn_inputs}
    needed = ("target_tokens", *LOSSES[loss_fn])
    missing = [k for k in needed if k not in inputs]
    if missing:
        raise UserError(f"{where}: loss {loss_fn!r} needs loss_fn_inputs {list(needed)}; missing {missing}")
    for name, arr in inputs.items():
        if len(arr) != n:
            raise UserError(f"{where}: loss_fn_inputs[{name!r}] has {len(arr)} entries for {n} input tokens; "
                            "every tensor needs one entry (row) per input token")
        if arr.ndim == 2 and (name not in ("target_tokens", "weights") or loss_fn != "cross_entropy"):
            raise UserError(f"{where}: loss_fn_inputs[{name!r}] is 2-D; only cross_entropy's target_tokens and "
                            "weights may be (N, K) (top-K distillation)")
        if loss_fn not in TOKEN_INPUTS.get(name, (loss_fn,)):
            raise UserError(f"{where}: loss {loss_fn!r} does not read loss_fn_inputs[{name!r}] (only "
                            f"{', '.join(TOKEN_INPUTS[name])} do); leave it out or choose one of those losses")
    wide = inputs["target_tokens"].ndim == 2
    if wide != ("weights" in inputs and inputs["weights"].ndim == 2) or (
            wide and inputs["weights"].shape != inputs["target_tokens"].shape):
        raise UserError(f"{where}: 2-D target_tokens need weights of the same (N, K) shape, and 2-D weights 2-D "
                        f"target_tokens; got {[list(inputs[k].shape) for k in ('target_tokens', 'weights') if k in inputs]}")
    if inputs["target_tokens"].min() < 0 or inputs["target_tokens"].max() >= vocab:
        raise UserError(f"{where}: target_tokens holds a token id outside the model's vocabulary [0, {vocab})")
    if wide:  # top-K: the (N, K) targets and weights; the 1-D fields carry column 0 (unused by the loss)
        k_targets = inputs["target_tokens"].astype(np.int64).tolist()
        k_weights = inputs["weights"].astype(np.float32).tolist()
        zeros = [0.0] * n
        return Datum(tokens, [r[0] for r in k_targets], [1.0] * n, zeros, zeros, [r[0] for r in k_weights],
                     target_k=k_targets, weights_k=k_weights, images=tuple(images))
    targets = inputs["target_tokens"].astype(np.int64).tolist()
    def row(name: str) -> Optional[list[float]]:
        return inputs[name].astype(np.float32).tolist() if name in inputs else None

    zeros = [0.0] * n
    ratio_mask = row("sequence_ratio_mask")
    if ratio_mask is not None and not any(ratio_mask):
        raise UserError(f"{where}: sequence_ratio_mask marks no token; mark the sampled tokens the sequence "
                        "ratio is taken over")
    return Datum(tokens, targets, [1.0] * n, row("advantages") or zeros, row("logprobs") or zeros,
                 (row("weights") or [1.0] * n) if loss_fn == "cross_entropy" else None,
                 ratio_mask, row("clip_low_threshold"), row("clip_high_threshold"), images=tuple(images))


def _spans(msg: Any, where: str, n: int) -> Optional[DatumSpans]:
    """A datum's provenance spans, each list checked to tile its field (``n`` positions)."""
    if not msg.model_input_spans and not msg.loss_fn_input_spans:
        return None
    out = []
    for field, runs in (("model_input", msg.model_input_spans), ("target_tokens", msg.loss_fn_input_spans)):
        spans = []
        for run in runs:
            kind = run.WhichOneof("span")
            arm = getattr(run, kind) if kind else None
            if arm is None or not arm.sequence_id or arm.offset < 0 or arm.length < 0:
                raise UserError(f"{where}: a {field} provenance span is empty or malformed; build spans with "
                                "Datum.with_provenance")
            spans.append(Span(kind, arm.sequence_id, int(arm.offset), int(arm.length)))
        total = sum(s.length for s in spans)
        if total != n:
            raise UserError(f"{where}: the {field} provenance spans cover {total} positions but the datum has {n}; "
                            "the runs must tile it exactly (Datum.with_provenance checks this client-side)")
        out.append(spans)
    return DatumSpans(*out)


def parse_train_call(body: bytes, limits_of: Any, loss_of: Optional[Callable[[str, str], Any]] = None) -> TrainCall:
    """A ``/forward_backward`` protobuf body -> :class:`TrainCall`; ``limits_of(model_id)`` gives the
    :class:`~otray.tinker.service.runs.ModelLimits` of the model it names (a :class:`UserError` for an unknown one),
    ``loss_of(model_id, loss_id)`` the :class:`~otray.tinker.learner.loss_graph.LossGraph` a ``custom`` loss names
    (None: custom losses are not served)."""
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise UserError("the forward_backward body is not a ForwardBackwardRequest protobuf message "
                        "(send it with the tinker SDK, Content-Type: application/x-protobuf)") from None
    if not msg.model_id:
        raise UserError("forward_backward: model_id is missing")
    try:
        return _train_call(msg, limits_of(msg.model_id), loss_of and (lambda i: loss_of(msg.model_id, i)))
    except UserError as e:
        e.model_id, e.seq_id = msg.model_id, int(msg.seq_id)
        raise


def _train_call(msg: Any, limits: Any, loss_of: Optional[Callable[[str], Any]] = None) -> TrainCall:
    """A parsed ForwardBackwardRequest checked against the model's vocabulary (and image inputs)."""
    loss, graph = msg.loss_fn, None
    raw: dict[str, Any] = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        raw[k] = v.number if v.WhichOneof("value") == "number" else v.text
    if loss == "custom" and loss_of is not None:
        loss_id = raw.pop("loss_id", None)
        if not isinstance(loss_id, str):
            raise UserError("loss_fn 'custom' needs loss_fn_config {'loss_id': <the id create_custom_loss gave>}; "
                            "pass the LossHandle to forward_backward_custom")
        graph = loss_of(loss_id)
    elif loss not in LOSSES:
        raise UserError(f"loss_fn {loss!r} is not supported by this service; choose one of {', '.join(LOSSES)}, "
                        "or a custom loss (ServiceClient.create_custom_loss + forward_backward_custom)")
    known = CONFIG_KEYS.get(loss, {})
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UserError(f"loss_fn {loss!r} takes no loss_fn_config key(s) {unknown}; valid: {sorted(known) or 'none'}")
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in raw.values()):
        raise UserError(f"loss_fn_config values must be finite numbers, got {raw}")
    if not msg.data:
        raise UserError("forward_backward: data is empty; send at least one datum")
    datums = [_custom_datum(d, graph, f"datum {i}", limits) if graph else _datum(d, loss, f"datum {i}", limits)
              for i, d in enumerate(msg.data)]
    widths = {None if d.target_k is None else len(d.target_k[0]) for d in datums}
    if len(widths) > 1:
        raise UserError(f"forward_backward: datums of one request must all be 1-D or all (N, K) with one K; "
                        f"got K in {sorted(widths, key=str)} (None: 1-D); send them in separate requests")
    spans = [_spans(d, f"datum {i}", len(datums[i])) for i, d in enumerate(msg.data)]
    if loss == "stable_reinforce" and None in spans:
        raise UserError(f"datum {spans.index(None)}: loss 'stable_reinforce' needs provenance on every datum "
                        "(Datum.with_provenance naming the sequence_id of each sampled run; sample with "
                        "record_stability_info=True)")
    return TrainCall(msg.model_id, int(msg.seq_id), loss, {known[k]: float(v) for k, v in raw.items()},
                     bool(msg.forward_only), datums, spans, graph)


def _batched(rows: list[list[float]], k: Optional[int] = None) -> Any:
    """Per-datum float rows as one ``BatchedTensor`` (byte offsets between datums); ``k``: each row is
    (N, k) flattened."""
    p = pb()
    data = np.concatenate([np.asarray(r, dtype=np.float32) for r in rows]) if rows else np.zeros(0, np.float32)
    offsets = np.cumsum([0, *[len(r) * 4 for r in rows]]).astype(np.int64)
    return p.BatchedTensor(data=data.tobytes(), offsets=offsets.tobytes(), dtype=p.DTYPE_FLOAT32,
                           trailing_shape=[k] if k else [])


def train_output(logprobs: list[list[float]], losses: list[list[float]], loss_sum: float,
                 k: Optional[int] = None, metrics: Optional[dict[str, float]] = None) -> bytes:
    """A ``ForwardBackwardOutput`` protobuf: per datum ``logprobs`` ((N, k) for top-K datums) and
    ``elementwise_loss``; metric ``loss:sum`` (the SDK sums it across the chunks of one call) and a custom
    loss's ``metrics``."""
    p = pb()
    record = p.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(_batched(logprobs, k))
    record.fields["elementwise_loss"].CopyFrom(_batched(losses))
    out = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics["loss:sum"] = float(loss_sum)
    for key, value in (metrics or {}).items():
        out.metrics[key] = float(value)
    return out.SerializeToString()
