"""The server-side custom loss interpreter (otray/tinker/learner/loss_graph.py) on graphs the real SDK traces and
encodes (``tinker``'s own ``trace_loss`` / ``encode_graph``): the interpreted loss, its gradient and its
metrics equal the traced function's run directly by torch; each graph the allow-list does not cover, and
each node that would touch more than the element budget, is a UserError naming the node. Pure: no Ray."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
import torch.nn.functional as F

tinker = pytest.importorskip("tinker")
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss  # noqa: E402

from otray.tinker.learner.loss_graph import LossGraph, parse_graph as parse_upload  # noqa: E402
from otray.tinker.wire.requests import GraphUpload  # noqa: E402
from otray.tinker.learner.loss_run import run_graph, surrogate  # noqa: E402
from otray.tinker.errors import UserError  # noqa: E402
from otray.types import Datum  # noqa: E402


def parse_graph(body: dict) -> LossGraph:
    """A create_custom_loss body, parsed as the service parses it (``GraphUpload.of``, then the graph)."""
    return parse_upload(GraphUpload.of(body))


def upload(fn, ranks: dict[str, int]) -> dict:
    """The JSON body ServiceClient.create_custom_loss sends for ``fn``."""
    handle = trace_loss(fn, ranks, "s-test")
    return {"session_id": "s-test", "custom_loss_seq_id": 0, "name": handle.name,
            "inputs": [i.model_dump(mode="json") for i in handle.inputs],
            "graph": encode_graph(handle).model_dump(mode="json")}


def ppo_like(logprobs, old, advantages, mask):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    kept = per_token[mask > 0]
    loss = kept.sum() / mask.sum().clamp(min=1.0) + 0.01 * F.softplus(-logprobs).mean()
    worst = logprobs.abs().max(dim=0).values
    return loss + 0.0 * worst, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": mask.sum(),
                                "custom/inf:sum": torch.where(torch.isfinite(logprobs), 0.0, math.inf).sum()}


def topk_distill(logprobs, teacher, scale):
    """Rank-2 logprobs [T, K] against a teacher's [T, K] log-distribution, with a scalar input."""
    probs = torch.softmax(teacher, dim=-1)
    picked = torch.gather(logprobs, 1, torch.argmax(teacher, dim=-1, keepdim=True))
    return -scale * (probs * logprobs).sum() - picked.sum(), {"custom/k:mean": logprobs.shape[1] * torch.ones_like(scale)}


def test_interpreted_losses_equal_the_traced_functions_value_gradient_and_metrics():
    torch.manual_seed(0)
    T, K = 7, 3
    cases = [(ppo_like, {"logprobs": 1, "old": 1, "advantages": 1, "mask": 1},
              [-torch.rand(T), -torch.rand(T), torch.randn(T), (torch.rand(T) > 0.3).float()]),
             (topk_distill, {"logprobs": 2, "teacher": 2, "scale": 0},
              [-torch.rand(T, K), torch.randn(T, K), torch.tensor(0.7)])]
    for fn, ranks, values in cases:
        graph = parse_graph(upload(fn, ranks))
        assert isinstance(graph, LossGraph) and graph.input_names == tuple(ranks)[1:]
        got_lp, want_lp = values[0].clone().requires_grad_(), values[0].clone().requires_grad_()
        got, got_metrics = run_graph(graph, [got_lp, *values[1:]], "cpu")
        want, want_metrics = fn(want_lp, *values[1:])
        got.backward()
        want.backward()
        assert torch.allclose(got, want) and torch.allclose(got_lp.grad, want_lp.grad)
        assert got_metrics.keys() == want_metrics.keys()
        assert all(torch.allclose(got_metrics[k].float(), want_metrics[k].float()) for k in want_metrics)


def test_the_surrogate_back_propagates_the_custom_losses_gradient():
    """``surrogate``: the per-token ``w * lp`` whose gradient is the custom loss's, over padded rows."""
    graph = parse_graph(upload(ppo_like, {"logprobs": 1, "old": 1, "advantages": 1, "mask": 1}))
    torch.manual_seed(1)
    lengths, width = [5, 3], 5
    rows = [[-torch.rand(n), -torch.rand(n), torch.randn(n), torch.ones(n)] for n in lengths]
    batch = [Datum([1] * n, [1] * n, [1.0] * n, [0.0] * n, [0.0] * n, custom_inputs=tuple(r[1:])) for n, r in
             zip(lengths, rows)]
    lp = torch.zeros(2, width)
    for i, r in enumerate(rows):
        lp[i, :lengths[i]] = r[0]
    lp.requires_grad_()
    tok, total, sums = surrogate(graph, batch, lp, "cpu")
    tok.sum().backward()
    for i, r in enumerate(rows):
        leaf = r[0].clone().requires_grad_()
        loss, _ = ppo_like(leaf, *r[1:])
        loss.backward()
        assert torch.allclose(lp.grad[i, :lengths[i]], leaf.grad, atol=1e-6)
        assert lp.grad[i, lengths[i]:].abs().sum() == 0
    assert total == pytest.approx(sum(float(ppo_like(r[0], *r[1:])[0]) for r in rows), rel=1e-5)
    assert sums["custom/tokens:sum"] == pytest.approx(sum(lengths))


def _mutated(body: dict, index: int, **changes) -> dict:
    out = copy.deepcopy(body)
    out["graph"]["nodes"][index].update(changes)
    return out


def test_graphs_outside_the_allow_list_are_refused_naming_the_node():
    body = upload(ppo_like, {"logprobs": 1, "old": 1, "advantages": 1, "mask": 1})
    nodes = body["graph"]["nodes"]
    exp = next(i for i, n in enumerate(nodes) if n["target"] == "torch.exp")
    bad = {
        "os.system": _mutated(body, exp, target="os.system"),
        "torch.zeros": _mutated(body, exp, target="torch.zeros"),  # takes a size
        "torch.matmul": _mutated(body, exp, target="torch.matmul"),
        "'add_'": _mutated(body, exp, op="call_method", target="add_"),  # in-place
        "modules or captured tensors": _mutated(body, exp, op="get_attr", target="weight"),
        "not an earlier node": _mutated(body, exp, args=[{"ref": "output"}]),
        "writes into a tensor": _mutated(body, exp, kwargs={"out": {"ref": "logprobs"}}),
        "reads an attribute other than": _mutated(body, exp, target="getattr", args=[{"ref": "logprobs"}, "__class__"]),
        "not in the SDK's encoding": _mutated(body, exp, args=[{"code": "print(1)"}]),
        "start with logprobs": {**body, "inputs": body["inputs"][1:]},
    }
    for says, graph in bad.items():
        with pytest.raises(UserError, match=says):
            parse_graph(graph)


@pytest.mark.parametrize("fn, says", [
    (lambda logprobs: ((logprobs[:, None] * logprobs[None, :]).sum(), {}), "over this datum's budget"),
    (lambda logprobs: (logprobs[torch.argmax(logprobs, dim=0, keepdim=True)].sum(), {}), "integer tensor"),
    (lambda logprobs: (torch.gather(logprobs, 0, (logprobs * 0 + 200_000).long()).sum(), {}), "gather's index"),
    (lambda logprobs: (logprobs.sum() * 1.0, {"custom/x:sum": logprobs}), "one-element tensor"),
    (lambda logprobs: (logprobs * 2, {}), "scalar float tensor"),
])
def test_nodes_that_would_harm_the_shared_learner_fail_as_the_users_error(fn, says):
    """An outer product of a long row, integer-tensor indexing, an out-of-range gather (a device-side
    assert on a GPU) and a malformed result: each a UserError at run time, before the node runs."""
    def loss(logprobs):
        return fn(logprobs)

    graph = parse_graph(upload(loss, {"logprobs": 1}))
    with pytest.raises(UserError, match=says):
        run_graph(graph, [-torch.rand(100_000)], "cpu")


def test_python_values_cannot_be_multiplied_into_memory_or_time():
    """``"a" * 10**12`` and ``10 ** 10**9`` are refused or made floats, never computed as Python objects."""
    body = upload(lambda logprobs: (logprobs.sum() * 2.0, {}), {"logprobs": 1})
    node = next(i for i, n in enumerate(body["graph"]["nodes"]) if n["target"] == "operator.mul")
    strings = _mutated(body, node, args=["a", 10 ** 12])
    with pytest.raises(UserError, match="operands must be tensors or numbers"):
        run_graph(parse_graph(strings), [-torch.rand(4)], "cpu")
    power = _mutated(body, node, target="operator.pow", args=[10, 10 ** 9])
    with pytest.raises(UserError, match="failed"):  # a float overflow, at once
        run_graph(parse_graph(power), [-torch.rand(4)], "cpu")


def gathered_pg(logprobs, old, advantages, index):
    """tests/fixtures/custom_loss.json's loss (tests/test_gpu.py runs it on CUDA, where the SDK is not installed)."""
    ratio = torch.exp(logprobs - old)
    per_token = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    picked = torch.gather(logprobs, 0, index.long())
    return per_token.sum() - 0.1 * picked.sum(), {"custom/ratio:mean": ratio.mean()}


def test_the_gpu_checks_custom_loss_fixture_is_what_the_sdk_sends_today():
    import json
    from pathlib import Path

    fixture = json.loads((Path(__file__).parents[1] / "fixtures" / "custom_loss.json").read_text())
    sent = upload(gathered_pg, {"logprobs": 1, "old": 1, "advantages": 1, "index": 1})
    assert {k: sent[k] for k in ("name", "inputs", "graph")} == fixture
    assert parse_graph(fixture).input_names == ("old", "advantages", "index")


def test_the_tensors_a_loss_makes_are_held_to_a_budget_and_deep_arguments_are_refused():
    """Each node's result counts against the datum's budget (autograd keeps them for the backward pass):
    a chain of 80 whole-sequence steps on a 100,000-token datum is refused at the node that crosses it;
    the same chain on a short datum runs. An argument nested past Python's recursion limit is a UserError."""
    def chain(logprobs):
        x = logprobs
        for _ in range(80):
            x = x * 1.0001
        return x.sum(), {}

    graph = parse_graph(upload(chain, {"logprobs": 1}))
    loss, _ = run_graph(graph, [-torch.rand(1000)], "cpu")
    assert loss.ndim == 0
    with pytest.raises(UserError, match="the loss's tensors reach"):
        run_graph(graph, [-torch.rand(100_000)], "cpu")
    body = upload(lambda logprobs: (logprobs.sum() * 2.0, {}), {"logprobs": 1})
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    node = next(i for i, n in enumerate(body["graph"]["nodes"]) if n["target"] == "operator.mul")
    with pytest.raises(UserError, match="nests too deeply"):
        parse_graph(_mutated(body, node, args=[deep, 2.0]))


def chain(n: int):
    """A loss of ``n`` multiplications by the literal 1.5 (n nodes past the input, n numbers in the graph)."""
    def loss(logprobs):
        x = logprobs
        for _ in range(n):
            x = x * 1.5
        return x.sum(), {}
    return loss


def test_each_custom_loss_limit_refuses_a_graph_just_past_it_and_serves_one_just_under():
    """custom_losses.max_nodes, max_graph_bytes and max_literal_numbers: a graph at the limit parses, the
    same graph under a limit one smaller is refused naming the setting."""
    import json

    from otray.tinker.config import CustomLossLimits

    body = upload(chain(12), {"logprobs": 1})
    measured = {"max_nodes": len(body["graph"]["nodes"]), "max_graph_bytes": len(json.dumps(body["graph"])),
                "max_literal_numbers": 12}
    for name, value in measured.items():
        assert parse_upload(GraphUpload.of(body), CustomLossLimits(**{name: value})).nodes
        with pytest.raises(UserError, match=f"custom_losses.{name}"):
            parse_upload(GraphUpload.of(body), CustomLossLimits(**{name: value - 1}))


def test_python_integers_are_held_within_2_63_and_devices_and_list_indices_are_refused():
    """The issue's hostile graphs: squaring a Python integer 20 times (each square 2.5-3x the time before)
    stops at the node that passes 2**63, at once; a literal past it is refused on upload; ``to("meta")`` and
    ``device="meta"`` are refused on upload naming the device (a dtype is fine); a Python-list index, which
    the integer-tensor check did not see, is refused before it runs."""
    import time

    def squares(logprobs):
        n = logprobs.size(0) + 1
        for _ in range(20):
            n = n * n
        return logprobs.sum() * (n % 2), {}

    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"Python integer past 2\*\*63"):
        run_graph(parse_graph(upload(squares, {"logprobs": 1})), [-torch.rand(8)], "cpu")
    assert time.perf_counter() - t0 < 1.0
    body = upload(lambda logprobs: (logprobs.sum() * 2.0, {}), {"logprobs": 1})
    node = next(i for i, n in enumerate(body["graph"]["nodes"]) if n["target"] == "operator.mul")
    with pytest.raises(UserError, match=r"integer past 2\*\*63"):
        parse_graph(_mutated(body, node, args=[{"ref": "logprobs"}, 2 ** 64]))
    with pytest.raises(UserError, match="names a device or tensor type \\('meta'\\)"):
        parse_graph(upload(lambda logprobs: (logprobs.to("meta").sum(), {}), {"logprobs": 1}))
    with pytest.raises(UserError, match="names a device"):
        parse_graph(upload(lambda logprobs: ((torch.ones_like(logprobs, device="meta") * logprobs).sum(), {}),
                           {"logprobs": 1}))
    ok = parse_graph(upload(lambda logprobs: (logprobs.to(torch.float64).sum(), {}), {"logprobs": 1}))
    assert run_graph(ok, [-torch.rand(4)], "cpu")[0].dtype == torch.float64
    listed = parse_graph(upload(lambda logprobs: (logprobs[[0, 2]].sum(), {}), {"logprobs": 1}))
    with pytest.raises(UserError, match="indexes a tensor with a list"):
        run_graph(listed, [-torch.rand(4)], "cpu")


def test_a_calls_custom_loss_stops_at_its_budget_of_learner_seconds():
    """1,990 cheap nodes over many datums (the issue's graph that held the learner 5.7 s): the call's clock,
    shared by its slices, fails it as the user's error soon after ``custom_losses.max_call_s``; a call
    within its budget runs and spends from its own clock."""
    import dataclasses

    from otray.tinker.config import CustomLossLimits
    from otray.tinker.learner.loss_run import GraphClock

    def many(logprobs):
        x = logprobs
        for _ in range(1990):
            x = torch.abs(x)
        return x.sum(), {}

    batch = [Datum(list(range(16)), list(range(16)), [1.0] * 16, [0.0] * 16, [0.0] * 16, [1.0] * 16)] * 64
    slices = []
    for _ in range(2):  # one slice of 8 datums, on this machine now (the bounds below are relative to it): the
        probe = dataclasses.replace(parse_upload(GraphUpload.of(upload(many, {"logprobs": 1}))), clock=GraphClock(1e9))
        surrogate(probe, batch[:8], -torch.rand(8, 16), "cpu")  # slower of two (a loaded CI machine varies)
        slices.append(probe.clock.spent_s)
    slice_s = max(slices)
    budget = round(2.5 * slice_s, 3)
    graph = parse_upload(GraphUpload.of(upload(many, {"logprobs": 1})), CustomLossLimits(max_call_s=budget))
    assert graph.call_s == budget and graph.datum_cost == len(graph.nodes) > 1990
    clock = GraphClock(graph.call_s)
    timed = dataclasses.replace(graph, clock=clock)
    ran, longest = 0, slice_s
    with pytest.raises(UserError, match=rf"budget of {budget:g} learner seconds \(custom_losses.max_call_s\)"):
        for k in range(400):  # slices of one call, as many as it takes: the clock, not a count, ends the call
            began = time.monotonic()
            surrogate(timed, batch[8 * (k % 8):8 * (k % 8) + 8], -torch.rand(8, 16), "cpu")
            longest = max(longest, time.monotonic() - began)
            ran += 1
    assert budget <= clock.spent_s < budget + 3 * longest, (ran, clock, slice_s, longest)
    small = dataclasses.replace(graph, clock=GraphClock(10 * slice_s))
    surrogate(small, batch[:2], -torch.rand(2, 16), "cpu")
    assert 0 < small.clock.spent_s < 10 * slice_s
