"""JSON forms of the answers otray tinker keeps as protobuf, for clients that do not ask for protobuf.

The SDK asks ``retrieve_future`` for protobuf (``Accept: application/x-protobuf``) and gets the bytes the
service stored; curl, other languages and older SDKs send no such header and get JSON instead
(:func:`proto_as_json`): the bytes decoded by the SDK's own reader (``tinker.proto.response_conv``), then
written with the field names of the Tinker HTTP API's JSON (``loss_fn_outputs`` of ``{data, dtype, shape}``
tensors and ``metrics``; ``sequences`` of ``{stop_reason, tokens, logprobs}`` and the prompt's logprobs).
JSON has no NaN or infinity: a non-finite number is written as ``null``.

Runs in the gateway's Serve replica."""

from __future__ import annotations

import math
from typing import Any

PROTO = "application/x-protobuf"
MESSAGES = ("ForwardBackwardOutput", "SampleResponse")  # the protobuf answers an Outcome may hold


def wants_proto(accept: str) -> bool:
    """Whether an ``Accept`` header names protobuf (otherwise the answer is JSON)."""
    return any(part.split(";")[0].strip().lower() == PROTO for part in accept.split(","))


def proto_as_json(body: bytes, message: str) -> dict[str, Any]:
    """A stored protobuf answer (``message``: one of :data:`MESSAGES`) as the JSON a JSON client gets."""
    from tinker.proto import response_conv

    if message == "ForwardBackwardOutput":
        out = response_conv.deserialize_forward_backward_output(body)
        return {"type": "forward_backward", "loss_fn_output_type": out.loss_fn_output_type,
                "loss_fn_outputs": [{k: _tensor(v) for k, v in record.items()} for record in out.loss_fn_outputs],
                "metrics": _finite(dict(out.metrics))}
    if message == "SampleResponse":
        r = response_conv.deserialize_sample_response(body)
        alt = r.prompt_alt_tokens
        return _finite({
            "type": "sample",
            "sequences": [{"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs,
                           "topk_logprobs": s.topk_logprobs} for s in r.sequences],
            "prompt_logprobs": r.prompt_logprobs, "topk_prompt_logprobs": r.topk_prompt_logprobs,
            "target_prompt_logprobs": _tensor(r.target_prompt_logprobs),
            "prompt_alt_tokens": None if alt is None else {"tokens": _tensor(alt.tokens), "logprobs": _tensor(alt.logprobs)},
            "prompt_cache_hit_tokens": r.prompt_cache_hit_tokens})
    raise ValueError(f"no JSON form for a protobuf {message!r} (known: {', '.join(MESSAGES)})")


def _tensor(t: Any) -> Any:
    return None if t is None else _finite({"data": t.data, "dtype": t.dtype, "shape": t.shape})


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float as None (tuples as lists)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v
