"""Packed linear kernels for CPU sampling (otray/actors/sampling/backends/packed.py)."""

import pytest
import torch

from otray.actors.sampling.backends import packed
from otray.actors.sampling.backends.hf import HFBackend
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


def test_sibling_projections_are_packed_as_one_product(tiny_path):
    """q/k/v and gate/up read the same input: one packed product each; o/down stay alone."""
    model = HFBackend(tiny_path).model
    alone, groups = packed.PackedLinears._plan(model)
    layers = model.model.layers
    assert len(groups) == 2 * len(layers)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert (attn.q_proj, attn.k_proj, attn.v_proj) in groups and (mlp.gate_proj, mlp.up_proj) in groups
        assert attn.o_proj in alone and mlp.down_proj in alone and attn.q_proj not in alone


def test_lora_wrapped_siblings_fall_back_to_packing_one_by_one(tiny_path):
    """With LoRA on q_proj and v_proj the attention siblings are no longer plain layers: their
    base layers and k_proj are packed alone, the MLP stays fused, and samples still match."""
    from peft import LoraConfig, get_peft_model

    def with_lora(backend):
        torch.manual_seed(3)
        backend.model = get_peft_model(backend.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False)).eval()
        return backend

    plain, fast = with_lora(HFBackend(tiny_path, packed_linears=False)), with_lora(HFBackend(tiny_path))
    alone, groups = packed.PackedLinears._plan(fast.model)
    attn = fast.model.base_model.model.model.layers[0].self_attn
    assert attn.q_proj.base_layer in alone and attn.k_proj in alone
    assert not any(attn.k_proj in g for g in groups) and len(groups) == len(fast.model.base_model.model.model.layers)
    want, got = plain.generate(PROMPTS, SAMPLED, 2), fast.generate(PROMPTS, SAMPLED, 2)
    for a, b in zip(sum(want, []), sum(got, [])):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_plan_is_kept_until_a_module_is_swapped(tiny_path):
    """The layers to pack are found once per model (kept while its modules stay), found again when a module is
    swapped in: the new layer is packed, the one it replaced is no longer touched."""
    backend = HFBackend(tiny_path)
    model, mlp = backend.model, backend.model.model.layers[0].mlp
    with backend.packed.active(model):
        pass
    kept = backend.packed.plans[model]
    with backend.packed.active(model):
        assert backend.packed.plans[model] is kept
    old = mlp.down_proj
    mlp.down_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with backend.packed.active(model):
        assert "forward" in mlp.down_proj.__dict__ and "forward" not in old.__dict__
    assert backend.packed.plans[model] is not kept
