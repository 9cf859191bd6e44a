"""Packed linear kernels for CPU sampling (otray/actors/backends/packed.py)."""

import pytest
import torch

from otray.actors.backends import packed
from otray.actors.backends.hf import HFBackend
from otray.types import SamplingParams

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch build has no oneDNN linear kernel")

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22]]


@pytest.fixture(autouse=True)
def pack_every_layer(monkeypatch):
    monkeypatch.setattr(packed, "MIN_ELEMENTS", 0)  # the tiny model's layers are below the size that pays


SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=7)


def test_packed_sampling_equals_the_ordinary_layers(tiny_path):
    plain = HFBackend(tiny_path, packed_linears=False).generate(PROMPTS, SAMPLED, 3)
    fast = HFBackend(tiny_path).generate(PROMPTS, SAMPLED, 3)
    for a, b in zip(sum(plain, []), sum(fast, [])):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_small_layers_are_left_alone_by_default(tiny_path, monkeypatch):
    monkeypatch.setattr(packed, "MIN_ELEMENTS", 1 << 18)
    backend = HFBackend(tiny_path)
    assert max(m.weight.numel() for m in backend.model.modules() if isinstance(m, torch.nn.Linear)) < 1 << 18
    with backend.packed.active(backend.model):
        assert not any("forward" in m.__dict__ for m in backend.model.modules())


def test_active_swaps_linear_forwards_for_inference_only_and_restores_them(tiny_path):
    backend = HFBackend(tiny_path)
    model, layer = backend.model, backend.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    calls = []
    with backend.packed.active(model):
        assert "forward" in layer.__dict__  # swapped on the instance
        with torch.inference_mode():
            calls.append(layer(x))
        y = layer(x)  # grad mode: the ordinary layer, so training works inside too
        y.sum().backward()
    assert "forward" not in layer.__dict__
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    assert calls[0] == pytest.approx(torch.nn.functional.linear(x, layer.weight, layer.bias).detach(), abs=1e-5)


def test_weights_changed_without_a_version_bump_are_repacked_on_invalidate(tiny_path):
    """A fused AdamW step does not bump ``_version``: the cache must not serve the old weights
    once the owner says they changed (``invalidate`` or ``weights_version``)."""
    backend, reference = HFBackend(tiny_path), HFBackend(tiny_path, packed_linears=False)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    backend.generate(PROMPTS, greedy, 1)  # packs
    with torch.no_grad():
        for p, q in zip(backend.model.parameters(), reference.model.parameters()):
            noise = torch.randn_like(p) * 0.2
            p.data.add_(noise)  # through .data: the parameter's _version does not move
            q.data.add_(noise)
    stale = backend.generate(PROMPTS, greedy, 1)
    want = reference.generate(PROMPTS, greedy, 1)
    assert sum((s[0].logprobs for s in stale), []) != pytest.approx(sum((s[0].logprobs for s in want), []), abs=1e-3)
    backend.packed.invalidate()
    fresh = backend.generate(PROMPTS, greedy, 1)
    for a, b in zip(fresh, want):
        assert a[0].token_ids == b[0].token_ids and a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)
