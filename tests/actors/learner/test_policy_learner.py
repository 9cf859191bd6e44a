"""PolicyLearner in-process: logprobs, gradient accumulation, micro-batching, state, export."""

import random

import pytest
import torch

from otray.actors.learner.core import micro_batches
from otray.actors.learner.policy_learner import PolicyLearner
from otray.algos.datums import sft_datum
from otray.types import Datum, LossNormalizer, ModelLoadError


def _datums(n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(5, 14)
        ids = [rng.randint(3, 300) for _ in range(L + 1)]
        mask = [0.0] * 3 + [1.0] * (L - 3)
        out.append(Datum(ids[:-1], ids[1:], mask, [rng.uniform(-1, 1) * m for m in mask],
                         [-rng.uniform(3, 7) * m for m in mask]))
    return out


def _flat(rows):
    return [x for r in rows for x in r]


def _grads(learner):
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["sum", "token_mean", "seq_mean_token_mean"])
def test_micro_batching_does_not_change_gradients(tiny_path, aggregation):
    data = _datums()
    big = PolicyLearner(tiny_path, micro_batch_tokens=10_000)
    small = PolicyLearner(tiny_path, micro_batch_tokens=20)
    assert len(micro_batches(data, 20)) > 2
    m1 = big.forward_backward(data, "ppo", {}, aggregation)
    m2 = small.forward_backward(data, "ppo", {}, aggregation)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    g1, g2 = _grads(big), _grads(small)
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6)


def test_a_padded_batch_gives_the_gradient_of_each_sequence_alone(tiny_path):
    """The ppo token-mean gradient of a padded batch (sequences of different lengths) equals the
    same loss computed sequence by sequence without padding (TRL's left-padded batches were
    measured 1e-2 off this reference: benchmarks/vs_trl_gradients.py)."""
    learner, ref = PolicyLearner(tiny_path), PolicyLearner(tiny_path)
    data = _datums(8, seed=3)
    assert len({len(d) for d in data}) > 1
    own = learner.forward(data)  # sampler logprobs = the learner's: ratio 1
    data = [Datum(d.input_ids, d.target_ids, d.mask, d.advantages, lp) for d, lp in zip(data, own)]
    learner.forward_backward(data, "ppo", {}, "token_mean")
    tokens = sum(sum(d.mask) for d in data)
    ref.model.train()
    for d in data:
        logits = ref.model(torch.tensor([d.input_ids])).logits[0].float()
        lp = logits.log_softmax(-1).gather(-1, torch.tensor(d.target_ids).unsqueeze(-1)).squeeze(-1)
        (-(torch.tensor(d.advantages) * torch.tensor(d.mask) * lp).sum() / tokens).backward()
    got, want = _grads(learner), _grads(ref)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-7)


def test_forward_matches_manual_logprobs(tiny_path):
    learner = PolicyLearner(tiny_path)
    d = _datums(1)[0]
    lp = learner.forward([d])[0]
    with torch.no_grad():
        logits = learner.model(torch.tensor([d.input_ids])).logits[0].log_softmax(-1)
    want = [logits[i, t].item() for i, t in enumerate(d.target_ids)]
    assert lp == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("rank", [0, 4])
def test_sft_steps_reduce_loss_and_bump_version(tiny_path, rank):
    learner = PolicyLearner(tiny_path, lora={"rank": rank, "alpha": 32})
    batch = [sft_datum([5, 6, 7], [8, 9, 10, 2])] * 4
    lr = 1e-2
    first = learner.forward_backward(batch, "cross_entropy")["loss"]
    learner.optim_step(learning_rate=lr)
    for _ in range(10):
        learner.forward_backward(batch, "cross_entropy")
        m = learner.optim_step(learning_rate=lr)
    last = learner.forward_backward(batch, "cross_entropy")["loss"]
    assert last < first * 0.85
    assert learner.version == 11 and m["grad_norm"] > 0


def test_save_and_load_state_restores_everything(tiny_path, tmp_path):
    a = PolicyLearner(tiny_path, lora={"rank": 4})
    data = _datums()
    a.forward_backward(data, "importance_sampling")
    a.optim_step(learning_rate=1e-2)
    a.extra_state = {"data_position": [0, 12]}
    a.save_state(str(tmp_path / "ck"))
    b = PolicyLearner(tiny_path, lora={"rank": 4})
    b.load_state(str(tmp_path / "ck"))
    assert (b.step, b.version, b.extra_state) == (1, 1, {"data_position": [0, 12]})
    assert _flat(b.forward(data)) == pytest.approx(_flat(a.forward(data)), abs=1e-6)
    # the optimizer state is restored too: one more identical step keeps them equal
    for learner in (a, b):
        learner.forward_backward(data, "importance_sampling")
        learner.optim_step(learning_rate=1e-2)
    assert _flat(b.forward(data)) == pytest.approx(_flat(a.forward(data)), abs=1e-5)
    with pytest.raises(ModelLoadError, match="no learner checkpoint"):
        b.load_state(str(tmp_path / "missing"))


def test_export_loads_in_transformers_and_peft(tiny_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = _datums(2)
    full = PolicyLearner(tiny_path)
    full.forward_backward(data, "ppo")
    full.optim_step(learning_rate=1e-2)
    m = AutoModelForCausalLM.from_pretrained(full.export(str(tmp_path / "full")))
    with torch.no_grad():
        lp = m(torch.tensor([data[0].input_ids])).logits[0].log_softmax(-1)
    assert [lp[i, t].item() for i, t in enumerate(data[0].target_ids)] == pytest.approx(full.forward(data[:1])[0], abs=1e-5)

    lora = PolicyLearner(tiny_path, lora={"rank": 4})
    lora.forward_backward(data, "ppo")
    lora.optim_step(learning_rate=1e-2)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), lora.export(str(tmp_path / "ad")))
    with torch.no_grad():
        lp = peft_model(input_ids=torch.tensor([data[0].input_ids])).logits[0].log_softmax(-1)
    assert [lp[i, t].item() for i, t in enumerate(data[0].target_ids)] == pytest.approx(lora.forward(data[:1])[0], abs=1e-5)


@pytest.mark.parametrize("rank", [0, 4])
def test_colocated_sampler_samples_from_the_weights_being_trained(tiny_path, rank, monkeypatch):
    """rollout.colocate: the learner's generate uses the model it trains, so after an optimizer step
    the sampler's logprobs are the learner's new logprobs (no stale copy: the packed sampling
    weights are rebuilt after the fused AdamW step), tagged with the new version."""
    from otray.actors.sampling.backends import packed
    from otray.types import SamplingParams

    monkeypatch.setattr(packed, "MIN_ELEMENTS", 0)  # pack the tiny model's layers too

    learner = PolicyLearner(tiny_path, lora={"rank": rank, "alpha": 32})
    info = learner.start_sampler(max_model_len=64)
    assert info.backend == "hf-colocated" and info.max_model_len == 64
    prompt, greedy = [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def learner_logprobs(toks):
        seq = prompt + toks
        zeros = [0.0] * (len(seq) - 1)
        return learner.forward([Datum(seq[:-1], seq[1:], zeros, zeros, zeros)])[0][-len(toks):]

    def sample_and_check():
        got = learner.generate([prompt], greedy)[0]
        toks = got.samples[0].token_ids
        assert got.samples[0].logprobs == pytest.approx(learner_logprobs(toks), abs=1e-4)
        return got, toks

    before, toks = sample_and_check()
    assert before.policy_version == 0
    batch = [sft_datum(prompt, [9, 10, 11, 12, 2])] * 4
    for _ in range(3):
        learner.forward_backward(batch, "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    after, _ = sample_and_check()
    assert after.policy_version == learner.update_weights() == 3
    assert learner_logprobs(toks) != pytest.approx(before.samples[0].logprobs, abs=1e-3)  # the weights did move


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_leaving_out_zero_advantage_datums_with_the_batch_normalizer_keeps_the_gradient(tiny_path, aggregation):
    """What drop_uniform_groups relies on: training on the datums with an advantage, normalized by the
    whole batch's tokens and sequences, gives the gradient of training on the whole batch."""
    informative = _datums(4, seed=1)
    zero = [Datum(d.input_ids, d.target_ids, d.mask, [0.0] * len(d), d.sampler_logprobs) for d in _datums(3, seed=2)]
    whole = PolicyLearner(tiny_path)
    whole.forward_backward(informative + zero, "ppo", aggregation=aggregation)
    part = PolicyLearner(tiny_path)
    both = informative + zero
    part.forward_backward(informative, "ppo", aggregation=aggregation,
                          normalizer=LossNormalizer(sum(sum(d.mask) for d in both), len(both)))
    unnormalized = PolicyLearner(tiny_path)
    unnormalized.forward_backward(informative, "ppo", aggregation=aggregation)
    g_whole, g_part, g_un = _grads(whole), _grads(part), _grads(unnormalized)
    assert g_whole.keys() == g_part.keys()
    for name in g_whole:
        assert torch.allclose(g_whole[name], g_part[name], atol=1e-6, rtol=1e-4), name
    assert not all(torch.allclose(g_whole[n], g_un[n], atol=1e-6, rtol=1e-4) for n in g_whole)  # the normalizer matters


def test_micro_batches_keep_short_rows_apart_from_long_ones():
    rows = [Datum([1] * n, [1] * n, [1.0] * n, [0.0] * n, [0.0] * n) for n in (5, 6, 7, 20, 30)]
    assert [len(c) for c in micro_batches(rows, 1000)] == [5]  # one chunk: the 5-token row padded to 30
    assert [[len(d) for d in c] for c in micro_batches(rows, 1000, 2.0)] == [[5, 6, 7], [20, 30]]
    assert [[len(d) for d in c] for c in micro_batches(rows, 40, 2.0)] == [[5, 6, 7], [20], [30]]  # budget too
