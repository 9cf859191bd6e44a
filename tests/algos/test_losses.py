"""Losses against an independent float64 per-token reference (values and gradients)."""

import math

import pytest
import torch

from otray.algos.losses import LOSS_NAMES, aggregate, loss_config, per_token_loss
from otray.types import ConfigError


def reference(name, lp, q, a, w, cfg):
    """Scalar float64 reference: (loss, d loss / d lp) for one token, written from the table."""
    r = math.exp(lp - q)
    if name == "cross_entropy":
        return -w * lp, -w
    if name == "importance_sampling":
        return -r * a, -r * a
    if name == "ppo":
        lo, hi = cfg["clip_low"], cfg["clip_high"]
        unclipped, clipped = r * a, min(max(r, lo), hi) * a
        if unclipped <= clipped:
            return -unclipped, -r * a
        # the clipped branch is active: its gradient is zero when the ratio is clipped
        return -clipped, (-r * a if lo <= r <= hi else 0.0)
    if name == "cispo":
        c = min(max(r, cfg["clip_low"]), cfg["clip_high"])
        return -c * a * lp, -c * a
    if name == "dro":
        b = cfg["beta"]
        return -(a * lp - b / 2 * (lp - q) ** 2), -(a - b * (lp - q))
    raise AssertionError(name)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_token_values_and_grads_match_reference(name, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (4, 7)
    lp = (-torch.rand(shape, generator=g, dtype=torch.float64) * 3).requires_grad_()
    q = lp.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.4
    a = torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.rand(shape, generator=g, dtype=torch.float64)
    cfg = loss_config(name)
    out = per_token_loss(name, lp, q, a, w, **cfg)
    assert out.shape == shape
    out.sum().backward()
    for idx in [(i, j) for i in range(shape[0]) for j in range(shape[1])]:
        val, grad = reference(name, lp[idx].item(), q[idx].item(), a[idx].item(), w[idx].item(), cfg)
        assert out[idx].item() == pytest.approx(val, rel=1e-9, abs=1e-12), idx
        assert lp.grad[idx].item() == pytest.approx(grad, rel=1e-9, abs=1e-12), idx


def test_ppo_clip_config_is_used():
    lp = torch.tensor([0.0], requires_grad=True)
    q = torch.tensor([-1.0])  # ratio e ~ 2.718
    a = torch.tensor([1.0])
    loose = per_token_loss("ppo", lp, q, a, clip_low=0.5, clip_high=3.0)
    tight = per_token_loss("ppo", lp, q, a, clip_low=0.8, clip_high=1.2)
    assert loose.item() == pytest.approx(-math.e)
    assert tight.item() == pytest.approx(-1.2)


def test_unknown_loss_and_key_are_config_errors():
    with pytest.raises(ConfigError, match="choose one of"):
        loss_config("pp0")
    with pytest.raises(ConfigError, match="clip_high"):
        loss_config("ppo", clip_hi=2.0)


def test_aggregations():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(losses, mask, "sum").item() == 7.0
    assert aggregate(losses, mask, "token_mean").item() == pytest.approx(7.0 / 3)
    assert aggregate(losses, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4.0) / 2)


@pytest.mark.parametrize("mode", ["sum", "token_mean", "seq_mean_token_mean"])
def test_aggregation_with_batch_normalizers_splits_exactly(mode):
    g = torch.Generator().manual_seed(0)
    losses = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    whole = aggregate(losses, mask, mode)
    kw = {"total_tokens": mask.sum().item(), "total_sequences": 6.0}
    parts = aggregate(losses[:2], mask[:2], mode, **kw) + aggregate(losses[2:], mask[2:], mode, **kw)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
