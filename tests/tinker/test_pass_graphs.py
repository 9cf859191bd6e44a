"""Bucketed shared passes (otray/tinker/learner/pass_graphs.py, ``models[i].graph_passes``): rows padded to a bucket,
each row's LoRA weights gathered from the bank by its slot, so that one shape and one code path serve any adapters
of a rank (a CUDA graph replays it on a GPU; here, on the CPU, the same passes run eagerly). Each request gets what
a pass of its own gives, each adapter the gradients and, over steps, the weights; passes a bucket cannot take run
the routed path. In-process, tiny model, float32: 1e-5."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from otray.tinker.learner.adapter_learner import AdapterLearner
from otray.tinker.learner.passes import PassRequest
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from tests.tinker.test_mixed_passes import datum, grads, same, same_grads


def learner_with(tiny_path: str, users: dict[str, AdapterSpec], graph_passes: bool = True) -> AdapterLearner:
    """A learner holding ``users``' adapters, their B weights made nonzero (so A's gradients are real too)."""
    learner = AdapterLearner(tiny_path, graph_passes=graph_passes)
    for i, (name, spec) in enumerate(users.items()):
        learner.create(name, spec)
        with torch.no_grad():
            for n, p in learner.model.named_parameters():
                if f".{name}." in n and "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
    return learner


def custom_graph():
    from otray.tinker.learner.loss_graph import parse_graph
    from otray.tinker.wire.requests import GraphUpload
    from tests.conftest import ROOT

    return parse_graph(GraphUpload.of(json.loads((ROOT / "tests" / "fixtures" / "custom_loss.json").read_text())))


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "dro", "topk", "custom"])
def test_a_bucketed_pass_gives_each_request_what_its_own_pass_gives(tiny_path, loss_fn):
    """Six users of rank 8, one or two datums of 5-20 tokens (9 rows: a bucket of 10 rows x 24, so padded rows
    and positions; an adapter with two rows adds them up), two passes (gradients accumulated over both):
    logprobs, losses, sums, metrics and every adapter's A and B gradients equal its own passes'; both passes
    went through the bucket."""
    users = {f"u{i}": AdapterSpec(8, seed=i) for i in range(6)}
    learner = learner_with(tiny_path, users)
    rng = np.random.default_rng(len(loss_fn))
    graph = custom_graph() if loss_fn == "custom" else None
    reqs = [PassRequest(name, [datum(rng, 5 + 3 * i, k=3 if loss_fn == "topk" else 0, custom=graph is not None)
                               for _ in range(1 + i % 2)], "cross_entropy" if loss_fn == "topk" else loss_fn, None,
                        True, graph) for i, name in enumerate(users)]
    mixed = [learner.forward_many(reqs) for _ in range(2)][-1]
    assert not any(isinstance(m, Exception) for m in mixed), mixed
    assert learner.graphs.counts["passes"] == 2 and len(learner.graphs.buckets) == 1
    key = next(iter(learner.graphs.buckets))
    assert (key.rows, key.width, key.rank, key.scale) == (10, 24, 8, 4.0)
    mixed_grads = {r.adapter: grads(learner, r.adapter) for r in reqs}
    alone = [[learner.forward_backward(r.adapter, r.datums, r.loss_fn, r.loss_fn_config, True, r.graph)
              for _ in range(2)][-1] for r in reqs]
    same(mixed, alone)
    same_grads(mixed_grads, learner, [r.adapter for r in reqs])


def test_a_forward_only_pass_has_buckets_of_its_own_and_leaves_no_gradient(tiny_path):
    """Forward requests (``backward=False``) go through forward-only buckets (no autograd graph: on a GPU the
    forward alone is captured): the logprobs and losses of their own passes, no gradient on any adapter; a
    forward_backward of the same shape then takes a bucket of its own."""
    users = {f"u{i}": AdapterSpec(8, seed=i) for i in range(3)}
    learner = learner_with(tiny_path, users)
    rng = np.random.default_rng(3)
    reqs = [PassRequest(name, [datum(rng, 7 + i)], "importance_sampling", backward=False)
            for i, name in enumerate(users)]
    mixed = learner.forward_many(reqs)
    assert learner.graphs.counts["passes"] == 1 and not next(iter(learner.graphs.buckets)).grad
    assert all(p.grad is None for n in users for p in learner._params(n))
    same(mixed, [learner.forward_backward(r.adapter, r.datums, r.loss_fn, None, False) for r in reqs])
    learner.forward_many([dataclasses.replace(r, backward=True) for r in reqs])
    assert [key.grad for key in learner.graphs.buckets] == [False, True]


def test_adapters_of_other_scales_share_a_bucket_with_a_scale_per_row(tiny_path):
    """Three rank-16 adapters with alphas 32, 16 and 8 (scales 2, 1 and 0.5): one bucket whose rows carry their
    scales; each request and gradient equal its own pass's. Buckets round up by eighths of an octave."""
    from otray.tinker.learner.pass_graphs import bucket_size

    assert [bucket_size(n) for n in (1, 5, 8, 9, 17)] == [1, 5, 8, 10, 20]
    assert [bucket_size(n, 8) for n in (3, 19, 64, 65, 100)] == [8, 24, 64, 80, 112]
    users = {f"s{i}": AdapterSpec(16, seed=i, alpha=32.0 / 2 ** i) for i in range(3)}
    learner = learner_with(tiny_path, users)
    rng = np.random.default_rng(2)
    reqs = [PassRequest(name, [datum(rng, 6 + i)], "cross_entropy") for i, name in enumerate(users)]
    mixed = learner.forward_many(reqs)
    key = next(iter(learner.graphs.buckets))
    assert key.scale is None and learner.graphs.counts["passes"] == 1
    mixed_grads = {r.adapter: grads(learner, r.adapter) for r in reqs}
    same(mixed, [learner.forward_backward(r.adapter, r.datums, r.loss_fn) for r in reqs])
    same_grads(mixed_grads, learner, [r.adapter for r in reqs])


def test_adapters_trained_in_bucketed_passes_equal_adapters_trained_alone(tiny_path):
    """Twin learners: one trains six users in bucketed passes and one fused optimizer call a step, the other
    each user alone; after three steps every adapter's weights are equal. Midway three more users join, so the
    rank-8 banks grow past their 8 slots: the buckets made on the old banks are dropped and new ones made, and
    the joiners' weights equal too."""
    users = {f"u{i}": AdapterSpec(8, seed=i) for i in range(6)}
    twins = [learner_with(tiny_path, users), learner_with(tiny_path, users, graph_passes=False)]
    rng = np.random.default_rng(4)
    data = {f"u{i}": [datum(rng, 4 + 2 * i)] for i in range(9)}
    # eps 1e-2: Adam with Tinker's default eps (1e-12) turns a gradient of 1e-7 into a step of +-lr, so float
    # noise of 4e-6 (the padded pass sums in another order) could flip a step's sign
    adam = AdamStep(learning_rate=1e-2, eps=1e-2)
    generations = []
    for step in range(3):
        if step == 2:
            for learner in twins:
                for i in range(6, 9):
                    learner.create(f"u{i}", AdapterSpec(8, seed=i))
        names = sorted(twins[1].specs)
        twins[0].forward_many([PassRequest(n, data[n], "cross_entropy") for n in names])
        twins[0].optim_many([(n, adam) for n in names])
        generations.append(twins[0].bank.generation)
        for n in names:
            twins[1].forward_backward(n, data[n], "cross_entropy")
            twins[1].optim_step(n, adam)
    assert generations[2] > generations[1]  # the banks grew at the third step
    assert twins[0].graphs.counts["passes"] == 3
    for n in sorted(twins[1].specs):
        for p, q in zip(twins[0]._params(n), twins[1]._params(n)):
            assert torch.allclose(p, q, atol=1e-5), n


def test_passes_a_bucket_cannot_take_run_the_routed_path(tiny_path):
    """Ranks that differ in one pass, adapters on other layers and a pass past the largest bucket run the routed
    path (no bucketed pass counted) and still equal their own passes; a failing custom loss in a bucketed pass
    fails alone and leaves its adapter no gradient, the others are served."""
    from otray.tinker.errors import UserError
    from otray.tinker.learner import pass_graphs

    users = {"one": AdapterSpec(8, seed=0), "two": AdapterSpec(8, seed=1), "wide": AdapterSpec(16, seed=2),
             "attn": AdapterSpec(8, seed=3, train_mlp=False)}
    learner = learner_with(tiny_path, users)
    rng = np.random.default_rng(6)
    data = {n: [datum(rng, 9)] for n in users}
    for pair in (["one", "wide"], ["one", "attn"]):
        reqs = [PassRequest(n, data[n], "cross_entropy") for n in pair]
        same(learner.forward_many(reqs), [learner.forward_backward(n, data[n], "cross_entropy") for n in pair])
    long = [datum(rng, pass_graphs.GRAPH_TOKENS // 8 + 1) for _ in range(8)]  # with two's row: 16 x 1024, too big
    learner.forward_many([PassRequest("one", long, "cross_entropy"), PassRequest("two", data["two"], "cross_entropy")])
    assert learner.graphs.counts["passes"] == 0
    for n in users:
        grads(learner, n)
    far = datum(rng, 6, custom=True)  # a gather index far past its rows: the fixture's loss fails on it
    far = dataclasses.replace(far, custom_inputs=(*far.custom_inputs[:2], np.full(6, 10 ** 6, np.float32)))
    out = learner.forward_many([PassRequest("one", [far], "custom", None, True, custom_graph()),
                                PassRequest("two", data["two"], "cross_entropy")])
    assert learner.graphs.counts["passes"] == 1
    assert isinstance(out[0], UserError) and "gather" in str(out[0])
    assert all(p.grad is None for p in learner._params("one"))
    got = grads(learner, "two")
    same([out[1]], [learner.forward_backward("two", data["two"], "cross_entropy")])
    for g, h in zip(got, grads(learner, "two")):
        assert torch.allclose(g, h, atol=1e-5, rtol=1e-4)


def test_graph_passes_is_a_model_setting_the_learner_honours(tiny_path):
    """``models[i].graph_passes`` (off by default) reaches the model's SharedLearner, whose learner then buckets
    its shared backward passes; off, it makes no PassGraphs."""
    from otray.tinker.config import load_tinker
    from otray.tinker.learner.shared_learner import SharedLearner

    assert not load_tinker({}).models[0].graph_passes
    assert load_tinker({"models": [{"name": "tiny", "graph_passes": True}]}).models[0].graph_passes
    on = SharedLearner(tiny_path, graph_passes=True).learner
    assert on.graph_passes
    on.create("x", AdapterSpec(4, seed=0))
    on.forward_many([PassRequest("x", [datum(np.random.default_rng(0), 5)], "cross_entropy")])
    assert on.graphs is not None and on.graphs.counts["passes"] == 1
    off = AdapterLearner(tiny_path)
    off.create("x", AdapterSpec(4, seed=0))
    off.forward_many([PassRequest("x", [datum(np.random.default_rng(0), 5)], "cross_entropy")])
    assert off.graphs is None


def test_a_bucketed_pass_built_as_under_a_cuda_capture_equals_own_passes(tiny_path, monkeypatch):
    """Under a CUDA stream capture transformers skips its host-side checks of the causal mask (``is_tracing``) and
    builds it on the device from the positions (``find_packed_sequence_indices``): a bucketed pass made that way,
    as its graph is captured on a GPU, still gives each request and gradient what its own pass gives."""
    from transformers import masking_utils

    built = []  # the masks of packed sequences made: None when transformers checked on the host that there are none

    def packed(*args, **kwargs):
        built.append(find(*args, **kwargs))
        return built[-1]

    find = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", packed)
    users = {f"u{i}": AdapterSpec(8, seed=i) for i in range(4)}
    learner = learner_with(tiny_path, users)
    rng = np.random.default_rng(9)
    reqs = [PassRequest(name, [datum(rng, 5 + 3 * i)], "cross_entropy") for i, name in enumerate(users)]
    with monkeypatch.context() as capturing:
        capturing.setattr(masking_utils, "is_tracing", lambda *a, **k: True)
        mixed = learner.forward_many(reqs)
    assert built and all(m is not None for m in built) and learner.graphs.counts["passes"] == 1
    mixed_grads = {r.adapter: grads(learner, r.adapter) for r in reqs}
    same(mixed, [learner.forward_backward(r.adapter, r.datums, r.loss_fn) for r in reqs])
    same_grads(mixed_grads, learner, [r.adapter for r in reqs])
