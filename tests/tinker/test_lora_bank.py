"""LoraBank: the training adapters' weights stacked per layer and rank, each adapter's parameters views of its slot
(otray/tinker/learner/lora_bank.py), on the CPU with the tiny model."""

from __future__ import annotations

import numpy as np
import torch

from otray.tinker.learner.adapter_learner import AdapterLearner
from otray.tinker.learner.mixed_lora import Segment
from otray.tinker.learner.passes import PassRequest
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from tests.tinker.test_mixed_passes import datum, grads, same


def weights(learner: AdapterLearner, name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner._params(name)]


def stacked(learner: AdapterLearner, names: list[str]):
    """The first LoRA layer's bank rows for ``names`` (None: not all of them are its slots' views)."""
    layer = next(m for m in learner.switch.lora_layers(learner.model) if names[0] in getattr(m, "lora_A", {}))
    seg = Segment("batched", 0, len(names), tuple(names))
    return layer, learner.routing.folded(layer, seg)


def test_adapters_keep_their_weights_in_a_growing_bank_and_a_pass_reads_them_in_place(tiny_path, tmp_path):
    """Ten rank-8 adapters (the banks start at 8 slots and double): every adapter's weights are what PEFT made
    (seeded), and a pass over adapters in consecutive slots reads a view of the bank, which an optimizer step
    updates in place; a dropped adapter's slot goes to the next one; slots out of order are gathered, and such a
    pass equals the users' own passes; a saved adapter loads back equal into a fresh learner."""
    learner = AdapterLearner(tiny_path)
    twin = AdapterLearner(tiny_path)  # its adapters made one by one in a learner of its own: PEFT's values
    names = [f"u{i}" for i in range(10)]
    made = {}
    for i, name in enumerate(names):
        learner.create(name, AdapterSpec(8, seed=i))
        twin.create(name, AdapterSpec(8, seed=i))
        made[name] = weights(twin, name)
    for name in names:  # the banks grew past 8 slots; the values moved with them
        assert all(torch.equal(a, b) for a, b in zip(weights(learner, name), made[name])), name
    assert sorted(slot for _, slot in learner.bank.slots.values()) == list(range(10))

    layer, folded = stacked(learner, names[2:6])
    assert folded.bank is not None and folded.bank.rows is None  # consecutive slots: a view, no copy
    assert folded.bank.a.data_ptr() == layer.lora_A["u2"].weight.data_ptr()
    rng = np.random.default_rng(3)
    reqs = [PassRequest(n, [datum(rng, 9)], "cross_entropy") for n in names[2:6]]
    learner.forward_many(reqs)
    before = folded.bank.a.clone()
    learner.optim_many([(n, AdamStep(learning_rate=1e-2)) for n in names[2:6]])
    learner.forward_many(reqs)
    learner.optim_many([(n, AdamStep(learning_rate=1e-2)) for n in names[2:6]])  # the fused AdamW call
    assert not torch.equal(folded.bank.a, before)
    assert torch.equal(folded.bank.a[1], layer.lora_A["u3"].weight)

    learner.drop("u4")
    learner.create("new", AdapterSpec(8, seed=99))
    assert learner.bank.slots["new"] == (8, 4)  # the freed slot
    learner.create("r32", AdapterSpec(32, seed=5))
    assert learner.bank.slots["r32"] == (32, 0)  # another rank: banks of its own

    order = ["u1", "u3", "u7", "new"]  # slots 1, 3, 7, 4: gathered
    _, folded = stacked(learner, order)
    assert folded.bank is not None and folded.bank.rows.tolist() == [1, 3, 7, 4]
    with torch.no_grad():
        for n in order:  # B nonzero: every product matters
            for m in learner.switch.lora_layers(learner.model):
                if n in getattr(m, "lora_B", {}):
                    m.lora_B[n].weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    reqs = [PassRequest(n, [datum(rng, 11)], "cross_entropy") for n in order]
    mixed = learner.forward_many(reqs)
    mixed_grads = {r.adapter: grads(learner, r.adapter) for r in reqs}
    alone = [learner.forward_backward(r.adapter, r.datums, r.loss_fn) for r in reqs]
    same(mixed, alone)
    for r in reqs:
        for g, h in zip(mixed_grads[r.adapter], grads(learner, r.adapter)):
            assert torch.allclose(g, h, atol=1e-5, rtol=1e-4), r.adapter

    learner.save("u3", str(tmp_path / "u3"), optimizer=True)
    fresh = AdapterLearner(tiny_path)
    fresh.load("u3", str(tmp_path / "u3"), optimizer=True, create=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh, "u3"), weights(learner, "u3")))
    layer, folded = stacked(fresh, ["u3"])  # loaded in place: its bank row holds the loaded weights
    assert folded.bank.a.data_ptr() == layer.lora_A["u3"].weight.data_ptr()
    assert torch.equal(folded.bank.a[0], layer.lora_A["u3"].weight)


def test_a_parameter_given_other_storage_is_stacked_as_it_is(tiny_path):
    """A parameter re-pointed behind the bank's back (``.data`` replaced) is not read from the bank: the pass
    stacks it as it is, and gives what the users' own passes give."""
    learner = AdapterLearner(tiny_path)
    names = ["a", "b", "c"]
    for i, name in enumerate(names):
        learner.create(name, AdapterSpec(8, seed=i))
    layer = next(m for m in learner.switch.lora_layers(learner.model) if "b" in getattr(m, "lora_A", {}))
    p = layer.lora_B["b"].weight
    p.data = torch.randn_like(p) * 0.02  # storage of its own
    assert learner.bank.stacked(layer, [layer.lora_A[n].weight for n in names],
                                [layer.lora_B[n].weight for n in names]) is None
    rng = np.random.default_rng(8)
    reqs = [PassRequest(n, [datum(rng, 10)], "cross_entropy") for n in names]
    mixed = learner.forward_many(reqs)
    for n in names:
        grads(learner, n)
    same(mixed, [learner.forward_backward(r.adapter, r.datums, r.loss_fn) for r in reqs])
