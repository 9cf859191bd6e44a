"""The JSON form of otray tinker's protobuf answers (``otray/tinker/wire/json_answers.py``): what a client that does
not ask for protobuf gets from ``retrieve_future``, checked against the SDK's own protobuf reader on the same
bytes. Pure: no Ray, no service (the HTTP side is in test_service.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("tinker")
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from otray.tinker.wire.json_answers import proto_as_json, wants_proto  # noqa: E402
from otray.tinker.wire.messages import train_output  # noqa: E402
from otray.tinker.wire.sampling import sample_output  # noqa: E402
from otray.types import FinishReason, Sample  # noqa: E402


def test_a_training_answer_in_json_equals_the_protobuf_one():
    body = train_output([[-0.5, -0.25, -1.0], [-2.0]], [[0.5, 0.25, 1.0], [2.0]], 3.75, None, {"custom/r:mean": 0.5})
    got = json.loads(json.dumps(proto_as_json(body, "ForwardBackwardOutput"), allow_nan=False))
    want = deserialize_forward_backward_output(body)
    assert got["loss_fn_output_type"] == want.loss_fn_output_type and got["metrics"] == want.metrics
    assert len(got["loss_fn_outputs"]) == len(want.loss_fn_outputs) == 2
    for g, w in zip(got["loss_fn_outputs"], want.loss_fn_outputs):
        assert g.keys() == w.keys() == {"logprobs", "elementwise_loss"}
        for key in g:
            assert np.allclose(g[key]["data"], w[key].data) and g[key]["dtype"] == w[key].dtype == "float32"
            assert g[key]["shape"] == w[key].shape
    topk = train_output([[-0.5, -1.5, -0.25, -2.5]], [[1.0, 2.0]], 3.0, 2)  # two positions, K = 2
    assert proto_as_json(topk, "ForwardBackwardOutput")["loss_fn_outputs"][0]["logprobs"]["shape"] == [2, 2]


def test_a_sampling_answer_in_json_equals_the_protobuf_one_with_non_finite_numbers_as_null():
    samples = [Sample([5, 6, 7], [-0.1, -2.0, -0.3], FinishReason.STOP), Sample([8], [-1.0], FinishReason.LENGTH)]
    body = sample_output(samples, [None, -1.5, -float("inf")])
    got = json.loads(json.dumps(proto_as_json(body, "SampleResponse"), allow_nan=False))
    want = deserialize_sample_response(body)
    assert got["type"] == "sample"
    assert [s["tokens"] for s in got["sequences"]] == [s.tokens for s in want.sequences] == [[5, 6, 7], [8]]
    assert [s["stop_reason"] for s in got["sequences"]] == ["stop", "length"]
    assert all(np.allclose(g["logprobs"], w.logprobs) for g, w in zip(got["sequences"], want.sequences))
    assert got["prompt_logprobs"] == [None, -1.5, None] and math.isinf(want.prompt_logprobs[2])
    with pytest.raises(ValueError, match="no JSON form"):
        proto_as_json(body, "Elsewhere")


def test_protobuf_only_when_the_accept_header_names_it():
    assert wants_proto("application/x-protobuf") and wants_proto("application/json, application/x-protobuf;q=0.9")
    assert not wants_proto("") and not wants_proto("*/*") and not wants_proto("application/json")
