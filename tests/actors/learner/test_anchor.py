"""The policy RL started from (otray/actors/learner/anchor.py) and algo.kl_coeff's pull towards it, in-process."""

import pytest
import torch

from otray.actors.learner.policy_learner import PolicyLearner
from tests.actors.learner.test_policy_learner import _datums


def _kl_after(learner, data, kl, steps=6):
    """Train ``steps`` ppo steps on ``data`` with ``kl``; the KL to the anchor the last step measured."""
    learner.set_anchor()
    for _ in range(steps):
        learner.forward_backward(data, "ppo", {}, "token_mean", None, kl)
        learner.optim_step(learning_rate=3e-3)
    return learner.forward_backward(data, "ppo", {}, "token_mean", None, 1e-9)["kl_to_start"]


def test_the_anchor_scores_with_the_starting_weights_and_leaves_the_trained_ones_in_place(tiny_path):
    data = _datums()
    learner = PolicyLearner(tiny_path)
    start = learner.forward(data)
    learner.set_anchor()
    learner.forward_backward(data, "ppo", {}, "token_mean")
    learner.optim_step(learning_rate=1e-2)
    trained = learner.forward(data)
    assert max(abs(a - b) for r1, r2 in zip(start, trained) for a, b in zip(r1, r2)) > 1e-3  # it moved
    ref = learner.anchor.logprobs(learner.model, data, "cpu", learner.precision.autocast("cpu"))
    for i, row in enumerate(start):
        assert ref[i, : len(row)].tolist() == pytest.approx(row, abs=1e-5)
    assert learner.forward(data) == trained  # the trained weights are back, bit for bit
    # a KL term right after set_anchor is 0 (the policy is its anchor) and then grows
    fresh = PolicyLearner(tiny_path)
    fresh.set_anchor()
    assert fresh.forward_backward(data, "ppo", {}, "token_mean", None, 0.5)["kl_to_start"] == pytest.approx(0, abs=1e-6)


def test_kl_coeff_keeps_the_policy_near_where_it_started(tiny_path):
    data = _datums()
    free = _kl_after(PolicyLearner(tiny_path, seed=0), data, kl=0.0)
    held = _kl_after(PolicyLearner(tiny_path, seed=0), data, kl=5.0)
    assert free > 0.01
    assert held < free / 3, (held, free)


def test_a_token_far_rarer_than_the_anchor_had_it_pulls_no_harder_than_the_cap():
    from otray.actors.learner.anchor import K3_CAP, kl_to_anchor

    lp = torch.tensor([-1.0, -1.5, -9.0], requires_grad=True)  # the policy's logprobs of three sampled tokens
    ref = torch.tensor([-1.0, -1.0, -1.0])  # the anchor's: the third token is now e^8 times rarer
    k3 = kl_to_anchor(lp, ref)
    k3.sum().backward()
    assert k3[0].item() == pytest.approx(0.0) and 0 < k3[1].item() < K3_CAP and k3[2].item() == K3_CAP
    d = 0.5  # below the cap: the k3 gradient, 1 - e^d, pulls the token back up
    assert lp.grad[:2].tolist() == pytest.approx([0.0, 1 - torch.exp(torch.tensor(d)).item()])
    assert lp.grad[2].item() == 0.0  # past it: no pull (uncapped it would be 1 - e^8, ~ -2980)


def test_forward_backward_with_a_kl_weight_needs_an_anchor(tiny_path):
    with pytest.raises(RuntimeError, match="set_anchor"):
        PolicyLearner(tiny_path).forward_backward(_datums(), "ppo", {}, "token_mean", None, 0.1)


def test_the_anchor_travels_with_the_checkpoint(tiny_path, tmp_path):
    data = _datums()
    learner = PolicyLearner(tiny_path)
    learner.set_anchor()
    learner.forward_backward(data, "ppo", {}, "token_mean")
    learner.optim_step(learning_rate=1e-2)
    learner.save_state(str(tmp_path / "ck"))
    again = PolicyLearner(tiny_path)
    again.load_state(str(tmp_path / "ck"))
    assert again.set_anchor(keep=True) is False  # it holds the saved one
    for name, t in learner.anchor.tensors.items():
        assert torch.equal(again.anchor.tensors[name], t)
    plain = tmp_path / "plain"
    PolicyLearner(tiny_path).save_state(str(plain))
    assert again.load_state(str(plain)) and again.anchor is None  # a checkpoint without one: none


def test_vision_lr_scale_slows_or_freezes_the_vision_tower_only(tmp_path):
    """model.vision_lr_scale on the tiny VLM: 0 freezes the vision tower (no gradients, unchanged), 0.1 moves it
    about a tenth as far as the language model's rate would (Adam: a step is ~lr per weight)."""
    from otray.actors.learner.core import new_adamw, trainable
    from otray.vlm import build_tiny_vlm, is_vision_param

    path = str(build_tiny_vlm(tmp_path / "vl"))
    moved = {}
    for scale in (1.0, 0.1, 0.0):
        learner = PolicyLearner(path, vision_lr_scale=scale)
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        for p in trainable(learner.model):
            p.grad = torch.ones_like(p)  # the same gradient everywhere: the step size is the learning rate's
        vision_norm = sum(p.numel() for n, p in learner.model.named_parameters()
                          if p.requires_grad and is_vision_param(n)) ** 0.5
        out = learner.optim_step(learning_rate=1e-3)
        # the vision tower's share of the step's gradient norm (ones: the root of its trained weights' count)
        assert out.get("grad_norm_vision", 0.0) == pytest.approx(vision_norm, rel=1e-5)
        assert scale == 0.0 or 0 < out["grad_norm_vision"] < out["grad_norm"]
        delta = {n: (p.detach() - before[n]).abs().max().item() for n, p in learner.model.named_parameters()}
        moved[scale] = (max(d for n, d in delta.items() if is_vision_param(n)),
                        max(d for n, d in delta.items() if not is_vision_param(n)))
        assert len(new_adamw(trainable(learner.model)).param_groups) == (2 if scale == 0.1 else 1)
    assert moved[1.0][0] == pytest.approx(1e-3, rel=0.05) and moved[0.1][0] == pytest.approx(1e-4, rel=0.05)
    assert moved[0.0][0] == 0.0
    assert all(lang == pytest.approx(1e-3, rel=0.05) for _, lang in moved.values())


def test_an_rl_step_moves_the_vision_tower_at_its_own_scale(tmp_path):
    """optim_step(vision_lr_scale=...) (an RL step's algo.vision_lr_scale): the vision tower's group at that times
    the step's rate, the language model as always; 0 leaves the tower where it was while its gradient still
    counts in the step's norm; None (a warm-up step) keeps model.vision_lr_scale."""
    from otray.actors.learner.core import trainable
    from otray.vlm import build_tiny_vlm, is_vision_param

    path = str(build_tiny_vlm(tmp_path / "vl"))
    learner = PolicyLearner(path, vision_lr_scale=0.1)
    moved = {}
    for rl_scale in (None, 0.0, 0.5):
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        for p in trainable(learner.model):
            p.grad = torch.ones_like(p)
        out = learner.optim_step(learning_rate=1e-3, vision_lr_scale=rl_scale)
        assert out["grad_norm"] == pytest.approx(sum(p.numel() for p in trainable(learner.model)) ** 0.5, rel=1e-5)
        delta = {n: (p.detach() - before[n]).abs().max().item() for n, p in learner.model.named_parameters()}
        moved[rl_scale] = (max(d for n, d in delta.items() if is_vision_param(n)),
                           max(d for n, d in delta.items() if not is_vision_param(n)))
    assert moved[None][0] == pytest.approx(1e-4, rel=0.05) and moved[0.5][0] == pytest.approx(5e-4, rel=0.05)
    assert moved[0.0][0] == 0.0
    assert all(lang == pytest.approx(1e-3, rel=0.05) for _, lang in moved.values())

