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
    if name == "stable_reinforce":
        cap, k = cfg["clip_high"], cfg["kl_coeff"]
        weight = min(r, cap)
        return -weight * a * lp + k * (r - 1 - (lp - q)), -weight * a + k * (r - 1)
    raise AssertionError(name)


def clipped_min(ratio, a, lo, hi):
    """PPO's ``-min(ratio*a, clip(ratio)*a)`` and its derivative with respect to the ratio."""
    unclipped, clipped = ratio * a, min(max(ratio, lo), hi) * a
    if unclipped <= clipped:
        return -unclipped, -a
    return -clipped, (-a if lo <= ratio <= hi else 0.0)


PER_TOKEN = [n for n in LOSS_NAMES if n != "gspo"]  # gspo's ratio is a sequence's: its own test


@pytest.mark.parametrize("name", PER_TOKEN)
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


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [(0.8, 1.2), (0.95, 1.02)])
def test_gspo_matches_a_sequence_level_reference(seed, clip):
    """Every token carries its row's geometric-mean ratio over the masked tokens (value), with the
    gradient of its own logprob only; clipping is of that sequence ratio."""
    g = torch.Generator().manual_seed(seed)
    shape = (3, 6)
    lp = (-torch.rand(shape, generator=g, dtype=torch.float64) * 3).requires_grad_()
    q = lp.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.2
    a = torch.randn(shape, generator=g, dtype=torch.float64)
    m = (torch.rand(shape, generator=g) > 0.4).double()
    m[:, 0] = 1.0
    lo, hi = clip
    out = per_token_loss("gspo", lp, q, a, ratio_mask=m, clip_low=lo, clip_high=hi)
    out.sum().backward()
    for i in range(shape[0]):
        picked = [(lp[i, j].item() - q[i, j].item()) for j in range(shape[1]) if m[i, j]]
        s = math.exp(sum(picked) / len(picked))
        for j in range(shape[1]):
            val, d_ratio = clipped_min(s, a[i, j].item(), lo, hi)
            assert out[i, j].item() == pytest.approx(val, rel=1e-9, abs=1e-12), (i, j)
            # d s_t / d lp_t = s (the sequence part is detached)
            assert lp.grad[i, j].item() == pytest.approx(d_ratio * s, rel=1e-9, abs=1e-12), (i, j)


def test_stable_reinforce_kl_term_and_ratio_mask():
    """With kl_coeff the k3 estimate of KL(sampler || learner) is added; tokens outside the ratio
    mask (not recorded by the sampler) contribute nothing, value or gradient."""
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([[-1.5, -0.5, -0.1]], dtype=torch.float64)
    a = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    out = per_token_loss("stable_reinforce", lp, q, a, ratio_mask=m, clip_high=1.5, kl_coeff=0.1)
    out.sum().backward()
    for j in range(3):
        val, grad = reference("stable_reinforce", lp[0, j].item(), q[0, j].item(), a[0, j].item(), 1.0,
                              {"clip_high": 1.5, "kl_coeff": 0.1})
        keep = m[0, j].item()
        assert out[0, j].item() == pytest.approx(val * keep, abs=1e-12)
        assert lp.grad[0, j].item() == pytest.approx(grad * keep, abs=1e-12)
    assert math.exp(-1.0 + 1.5) > 1.5  # token 0's ratio is over the cap: its weight is the cap
    assert lp.grad[0, 0].item() == pytest.approx(-1.5 * 1.0 + 0.1 * (math.exp(0.5) - 1))


@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_per_token_clip_thresholds_override_the_config_where_given(name):
    """A token with its own thresholds is clipped by them; a NaN token by the config's."""
    lp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    q = torch.tensor([[-1.0, -1.0, -1.0]])  # every ratio (and the sequence ratio) is e ~ 2.718
    a = torch.tensor([[1.0, 1.0, 1.0]])
    nan = float("nan")
    low = torch.tensor([[0.5, nan, 0.5]])
    high = torch.tensor([[3.0, nan, 2.0]])
    out = per_token_loss(name, lp, q, a, clip_tokens=(low, high), clip_low=0.8, clip_high=1.2)
    if name == "cispo":  # -sg(clip(r)) * A * lp with lp = 0: the loss is 0; the gradient shows the clip
        out.sum().backward()
        assert lp.grad[0].tolist() == pytest.approx([-math.e, -1.2, -2.0])
    else:
        assert out[0].tolist() == pytest.approx([-math.e, -1.2, -2.0])


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
