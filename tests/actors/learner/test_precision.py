"""Precision and memory of a learner (otray/actors/learner/precision.py), checked on the CPU: bf16
full-parameter training keeps float32 master weights, which an lr-1e-6 step moves where a bf16 AdamW
does not; LoRA keeps a low-precision base; the micro-batch budget follows memory and model shape."""

from __future__ import annotations

import pytest
import torch

from otray.actors.learner.core import LossSums, batch_stats, new_adamw, token_logprobs, trainable
from otray.actors.learner.precision import (Precision, activation_bytes_per_token, learner_precision,
                                            micro_batch_token_budget)
from otray.algos.datums import sft_datum


@pytest.mark.parametrize("dtype, device, lora, expected", [
    ("auto", "cpu", False, Precision("float32")),
    ("auto", "cuda", False, Precision("float32", "bfloat16")),  # master weights, bf16 autocast
    ("bfloat16", "cpu", False, Precision("float32", "bfloat16")),
    ("float16", "cuda", False, Precision("float32", "float16")),
    ("auto", "cuda", True, Precision("bfloat16")),  # LoRA: the frozen base in bf16, PEFT adapters in fp32
    ("float32", "cuda", False, Precision("float32")),
])
def test_what_a_learner_stores_and_computes_in(dtype, device, lora, expected):
    got = learner_precision(dtype, device, lora)
    assert got == expected
    assert got.master_weights == (expected.compute is not None)


def _batch(tokenizer, n=4):
    return [sft_datum(tokenizer.encode(f"{a}+{a}="), tokenizer.encode(str(2 * a)) + [tokenizer.eos_token_id])
            for a in range(10, 10 + n)]


def test_a_tiny_lr_bf16_step_moves_fp32_master_weights_where_a_bf16_adamw_does_not(tiny_path, tokenizer):
    """At lr 1e-6 an AdamW update is ~1e-6 per weight; a bf16 weight of |w| ~ 0.02 has a half-ulp of
    ~6e-5, so a bf16 AdamW rounds nearly every update away. The learner keeps float32 master weights
    (and float32 Adam state) under bf16 autocast, so the same step moves every trained weight."""
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.models import load_model

    data = _batch(tokenizer)
    learner = PolicyLearner(tiny_path, dtype="bfloat16", seed=0)
    assert learner.precision == Precision("float32", "bfloat16")
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    learner.forward_backward(data, "cross_entropy")
    learner.optim_step(learning_rate=1e-6, grad_clip=None)
    assert {s["exp_avg"].dtype for s in learner.optimizer.state.values()} == {torch.float32}
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in learner.model.named_parameters())
    total = sum(p.numel() for p in learner.model.parameters())

    # the same step on bf16 parameters with a bf16 AdamW (what a plain bf16 learner would do)
    torch.manual_seed(0)
    low = load_model(tiny_path, "bfloat16")
    start = {n: p.detach().clone() for n, p in low.named_parameters()}
    lp, valid = token_logprobs(low, data)
    (-(lp * valid).sum()).backward()
    opt = new_adamw(trainable(low), lr=1e-6)
    opt.step()
    moved_low = sum(int((p.detach() != start[n]).sum()) for n, p in low.named_parameters())
    assert moved / total > 0.9, (moved, total)
    assert moved_low / total < 0.2, (moved_low, total)


def test_lora_in_bf16_keeps_a_bf16_base_and_float32_adapters(tiny_path, tokenizer):
    from otray.actors.learner.policy_learner import PolicyLearner

    learner = PolicyLearner(tiny_path, dtype="bfloat16", lora={"rank": 4})
    dtypes = {("lora_" in n, p.dtype) for n, p in learner.model.named_parameters()}
    assert (True, torch.float32) in dtypes and (False, torch.bfloat16) in dtypes
    out = learner.forward_backward(_batch(tokenizer), "cross_entropy")
    assert out["loss"] > 0 and learner.optim_step(learning_rate=1e-3)["grad_norm"] > 0


def test_gradient_checkpointing_gives_the_same_gradients(tiny_path, tokenizer):
    from otray.actors.learner.policy_learner import PolicyLearner

    data = _batch(tokenizer)
    grads = []
    for checkpointing in (False, True):
        learner = PolicyLearner(tiny_path, seed=0, gradient_checkpointing=checkpointing)
        learner.forward_backward(data, "cross_entropy")
        grads.append(torch.cat([p.grad.flatten() for p in trainable(learner.model)]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_the_micro_batch_budget_follows_memory_and_shape():
    shape = dict(hidden=896, layers=24, vocab=151_936, intermediate=4864)  # Qwen2.5-0.5B
    per_token = activation_bytes_per_token(**shape)
    # by hand: 24 layers x (12 x 896 + 4 x 4864) x 2 bytes + 151,936 x (12 + 2) bytes
    assert per_token == 24 * (12 * 896 + 4 * 4864) * 2 + 151_936 * 14
    gib = 1 << 30
    budget = micro_batch_token_budget(40 * gib, **shape)
    assert budget == int(40 * gib * 0.7) // per_token // 64 * 64
    assert micro_batch_token_budget(20 * gib, **shape) < budget  # less memory, fewer tokens
    assert micro_batch_token_budget(40 * gib, checkpointing=True, **shape) > budget  # checkpointing keeps less
    assert micro_batch_token_budget(40 * gib, **{**shape, "vocab": 32_000}) > budget  # the logits dominate
    assert micro_batch_token_budget(0, **shape) == 256  # never below the floor
    assert micro_batch_token_budget(10**15, **shape) == 1 << 20


def test_the_budget_is_resolved_on_the_cpu_and_metrics_carry_the_largest_logprob_gap(tiny_path, tokenizer):
    from otray.actors.learner.policy_learner import PolicyLearner

    learner = PolicyLearner(tiny_path, micro_batch_tokens=0)
    assert learner.token_budget() == 8192
    data = _batch(tokenizer)
    for d, shift in zip(data, (0.0, 0.5, 0.0, 0.1)):
        d.sampler_logprobs = [lp + (shift if m else 0.0) for lp, m in
                              zip(learner.forward([d])[0], d.mask)]
    out = learner.forward_backward(data, "importance_sampling")
    assert out["logprob_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert 0 < out["logprob_diff_mean"] < out["logprob_diff_max"]


def test_loss_sums_of_device_rows_and_their_sum_over_ranks():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    q = torch.tensor([[-1.0, -2.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    row = batch_stats(torch.tensor(0.25), lp, q, mask, "ppo", {})
    sums = LossSums.of([row, row], tokens=4, sequences=2)
    assert sums.loss == pytest.approx(0.5) and sums.absdiff == pytest.approx(1.0) and sums.absdiff_max == 0.5
    assert sums.nll == pytest.approx(2 * (1.0 + 2.5))  # the masked sampled tokens' -q, both rows
    assert sums.metrics("ppo")["entropy"] == pytest.approx(7.0 / 4)
    both = sums.plus(LossSums(absdiff_max=2.0, tokens=1, sequences=1))
    assert both.absdiff_max == 2.0 and both.tokens == 5 and both.absdiff == pytest.approx(1.0)
