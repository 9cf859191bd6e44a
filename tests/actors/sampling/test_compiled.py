"""The compiled sampler (``rollout.sampler: compiled``, ``backends/compiled.py``) against the eager one
and the learner: the same greedy tokens, the learner's logprobs, weight updates (full, LoRA, a
colocated learner's own steps) seen without a recompile, and at most one compile per bucket.

Inductor itself runs in the first test (one bucket: ~10 s on 2 cores); the others capture graphs with
dynamo's ``eager`` backend, whose compile counters are the same."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from otray.actors.learner.policy_learner import PolicyLearner
from otray.actors.sampling.backends.compiled import buckets, choose_sampler
from otray.actors.sampling.backends.hf import HFBackend
from otray.algos.datums import sft_datum
from otray.types import ConfigError, Datum, FinishReason, SamplingParams


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def prompts(tokenizer):
    # different lengths: each row keeps its own slots from 0, as left padding keeps them for the eager sampler
    return [tokenizer.encode(q) for q in ("12+34=", "What is 7*8? Think, then answer:", "hi")]


def learner_logprobs(learner, prompt, tokens):
    seq = prompt + tokens
    zeros = [0.0] * (len(seq) - 1)
    return learner.forward([Datum(seq[:-1], seq[1:], zeros, zeros, zeros)])[0][len(prompt) - 1:]


def test_inductor_greedy_tokens_equal_eager_and_logprobs_equal_the_learner(tiny_path, prompts):
    eager = HFBackend(tiny_path, max_model_len=96, sampler="eager")
    compiled = HFBackend(tiny_path, max_model_len=96, max_batch=4, sampler="compiled")
    assert compiled.sampler == "compiled" and compiled.compile_s > 0
    before = graphs()
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    want, got = eager.generate(prompts, greedy, 1), compiled.generate(prompts, greedy, 1)
    assert [r[0].token_ids for r in got] == [r[0].token_ids for r in want]
    assert graphs() == before  # warmed up when it started: the call compiled nothing
    learner = PolicyLearner(tiny_path)
    sampled = compiled.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=4), 2)
    for prompt, samples in zip(prompts, sampled):
        for s in samples:
            assert s.logprobs == pytest.approx(learner_logprobs(learner, prompt, s.token_ids), abs=1e-4)


def test_compiles_once_for_every_bucket_and_never_after_the_warm_up(tiny_path, prompts):
    before = graphs()
    backend = HFBackend(tiny_path, max_model_len=64, max_batch=20, sampler="compiled", compile_backend="eager")
    assert buckets(20) == (8, 16, 20) and graphs() - before == 1  # the row count is dynamic: one graph
    warmed = graphs()
    for rows in (1, 2, 7, 8, 9, 16, 17, 20):  # each padded to its bucket
        out = backend.generate((prompts * 7)[:rows], SamplingParams(max_tokens=5, temperature=1.0), 1)
        assert len(out) == rows and all(len(r[0].token_ids) >= 1 for r in out)
    backend.generate(prompts, SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, seed=1), 9)  # 27 rows
    assert graphs() == warmed


def test_weight_updates_full_and_lora_are_followed_without_a_recompile(tiny_path, tokenizer, prompts):
    worker = HFBackend(tiny_path, max_model_len=64, max_batch=4, sampler="compiled", compile_backend="eager")
    warmed = graphs()
    learner = PolicyLearner(tiny_path)
    target = tokenizer.encode("46", add_special_tokens=False) + [tokenizer.eos_token_id]
    for _ in range(40):
        learner.forward_backward([sft_datum(prompts[0], target)], "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    worker.load_full_weights(learner.weights().tensors)
    out = worker.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), 1)[0][0]
    assert out.token_ids == target and out.finish_reason is FinishReason.STOP
    lora = PolicyLearner(tiny_path, lora={"rank": 8, "alpha": 16})
    with torch.no_grad():
        for name, p in lora.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.3)
    worker.load_full_weights(PolicyLearner(tiny_path).weights().tensors)  # LoRA applies on the base
    update = lora.weights()
    worker.load_lora(update.tensors, update.lora_config, 1)
    sampled = worker.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=2), 1)
    for prompt, (s,) in zip(prompts, sampled):
        assert s.logprobs == pytest.approx(learner_logprobs(lora, prompt, s.token_ids), abs=1e-4)
    assert graphs() == warmed


def test_a_colocated_learner_samples_its_new_weights_without_a_recompile(tiny_path):
    learner = PolicyLearner(tiny_path, lora={"rank": 4, "alpha": 16})
    info = learner.start_sampler(max_model_len=48, max_batch=2, sampler="compiled", compile_backend="eager")
    assert info.sampler == "compiled"
    warmed, prompt = graphs(), [5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = learner.generate([prompt], greedy)[0].samples[0]
    for _ in range(3):
        learner.forward_backward([sft_datum(prompt, [9, 10, 11, 12, 2])] * 2, "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    after = learner.generate([prompt], greedy)[0].samples[0]
    assert after.logprobs == pytest.approx(learner_logprobs(learner, prompt, after.token_ids), abs=1e-4)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    assert graphs() == warmed


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_token(tiny_path, prompts):
    backend = HFBackend(tiny_path, max_model_len=64, max_batch=4, sampler="compiled", compile_backend="eager")
    greedy = [r[0].token_ids for r in backend.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), 1)]
    for params in (SamplingParams(max_tokens=6, top_k=1, seed=3), SamplingParams(max_tokens=6, top_p=1e-6, seed=3)):
        assert [r[0].token_ids for r in backend.generate(prompts, params, 1)] == greedy


def test_auto_is_eager_on_the_cpu_and_compiled_refuses_a_vision_model(tiny_path, vl_path):
    assert HFBackend(tiny_path, max_model_len=32, sampler="auto").sampler == "eager"
    from otray.models import load_model

    vlm = load_model(vl_path)
    assert choose_sampler("auto", vlm, "cuda") == "eager"
    with pytest.raises(ConfigError, match="compiled cannot sample a vision-language model"):
        choose_sampler("compiled", vlm, "cuda")
    with pytest.raises(ConfigError, match="rollout.sampler='fast'"):
        choose_sampler("fast", vlm, "cpu")
