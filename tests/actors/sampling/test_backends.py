"""One suite, both backends: generation, logprob agreement with the learner, weight sync.

Logprob agreement is the contract that makes importance ratios meaningful: for the
same tokens, sampler and learner logprobs (float32, temperature 1) must agree to
a mean absolute difference below 1e-3, before and after every kind of update.
"""

import pytest
import torch

from otray.actors.learner.policy_learner import PolicyLearner
from otray.actors.sampling.rollout import RolloutWorker
from otray.algos.datums import sft_datum
from otray.models import chat_prompt_ids
from otray.types import Datum, FinishReason, PromptTooLongError, SamplingParams

BACKENDS = ["hf", "hf-compiled", pytest.param("vllm", marks=pytest.mark.vllm)]
# the compiled sampler under dynamo's graph capture without inductor's code generation (seconds, not a
# minute, to warm up on 2 cores); tests/actors/sampling/test_compiled.py runs inductor itself
COMPILED = {"sampler": "compiled", "compile_backend": "eager", "max_batch": 16}


@pytest.fixture(scope="module", params=BACKENDS)
def worker(request, tiny_path):
    backend, extra = ("hf", COMPILED) if request.param == "hf-compiled" else (request.param, {})
    w = RolloutWorker(tiny_path, backend, max_model_len=256, max_lora_rank=8, seed=0, **extra)
    assert w.info().sampler == ("compiled" if extra else w.info().sampler)
    yield w
    w.shutdown()


@pytest.fixture
def prompts(tokenizer):
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in ("12+34=", "What is 7*8?")]


def _mean_abs_diff(learner, prompt, sample):
    seq = prompt + sample.token_ids
    n = len(seq) - 1
    d = Datum(seq[:-1], seq[1:], [0.0] * n, [0.0] * n, [0.0] * n)
    lp = learner.forward([d])[0][len(prompt) - 1:]
    assert len(lp) == len(sample.logprobs)
    return sum(abs(a - b) for a, b in zip(lp, sample.logprobs)) / len(lp)


def _assert_logprobs_match(worker, learner, prompts):
    results = worker.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=3), n=3)
    diffs = [_mean_abs_diff(learner, p, s) for p, r in zip(prompts, results) for s in r.samples]
    assert max(diffs) < 1e-3, diffs


def test_generate_shapes_and_logprobs(worker, prompts):
    if worker.backend.name == "vllm":  # on the CPU the engine runs here: no engine or worker process spawned,
        import psutil  # each of which would import torch and vLLM again

        spawned = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        assert not [c for c in spawned if "multiprocessing" in c], spawned
    results = worker.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=1), n=4)
    assert len(results) == 2
    for r in results:
        assert len(r.samples) == 4 and r.policy_version == worker.policy_version()
        for s in r.samples:
            assert 1 <= len(s.token_ids) <= 8 and len(s.logprobs) == len(s.token_ids)
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert (s.finish_reason is FinishReason.LENGTH) == (len(s.token_ids) == 8 and s.token_ids[-1] not in worker.backend.stop_token_ids)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    assert worker.generate(prompts, greedy, 1)[0].samples[0].token_ids == worker.generate(prompts, greedy, 1)[0].samples[0].token_ids


def test_prompt_longer_than_context_is_a_clear_error(worker):
    with pytest.raises(PromptTooLongError, match="300 tokens but the model context is 256"):
        worker.generate([[5] * 300], SamplingParams(max_tokens=4), 1)


def test_sampler_logprobs_match_learner_base(worker, tiny_path, prompts):
    worker.update_weights(PolicyLearner(tiny_path).weights())  # back to base weights
    _assert_logprobs_match(worker, PolicyLearner(tiny_path), prompts)


def test_full_update_then_match_and_stop(worker, tiny_path, tokenizer, prompts):
    learner = PolicyLearner(tiny_path)
    eos = tokenizer.eos_token_id
    target = tokenizer.encode("46", add_special_tokens=False) + [eos]
    batch = [sft_datum(prompts[0], target)]
    for _ in range(40):
        learner.forward_backward(batch, "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    version = worker.update_weights(learner.weights())
    assert version == learner.version == worker.policy_version()
    out = worker.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), 1)[0].samples[0]
    assert out.token_ids == target and out.finish_reason is FinishReason.STOP
    _assert_logprobs_match(worker, learner, prompts)


def test_lora_update_then_match(worker, tiny_path, prompts):
    worker.update_weights(PolicyLearner(tiny_path).weights())  # LoRA applies on top of the base
    learner = PolicyLearner(tiny_path, lora={"rank": 8, "alpha": 16})
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    learner.version = 5
    base_lp = worker.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), 1)[0].samples[0].logprobs
    assert worker.update_weights(learner.weights()) == 5
    _assert_logprobs_match(worker, learner, prompts)
    new_lp = worker.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), 1)[0].samples[0].logprobs
    assert new_lp != base_lp


def test_stop_strings_end_a_sample_at_the_token_that_completes_them(worker, tokenizer, prompts):
    from dataclasses import replace

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = worker.generate(prompts[:1], greedy, 1)[0].samples[0]
    text = tokenizer.decode(full.token_ids, skip_special_tokens=False)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = next(k for k in range(1, len(full.token_ids) + 1)
                    if stop in tokenizer.decode(full.token_ids[:k], skip_special_tokens=False))
    cut = worker.generate(prompts[:1], replace(greedy, stop=(stop,)), 1)[0].samples[0]
    assert cut.finish_reason is FinishReason.STOP_STRING
    assert cut.token_ids == full.token_ids[:expected]  # every token up to the completing one, as sampled
    assert cut.logprobs == pytest.approx(full.logprobs[:expected], abs=1e-4)
    never = worker.generate(prompts[:1], replace(greedy, stop=("\x01never",)), 1)[0].samples[0]
    assert never.token_ids == full.token_ids and never.finish_reason is FinishReason.LENGTH


def test_ignore_eos_generates_exactly_max_tokens(worker, tiny_path, tokenizer, prompts):
    # a policy trained to stop right away still runs to max_tokens when asked to ignore eos
    learner = PolicyLearner(tiny_path)
    batch = [sft_datum(p, [tokenizer.eos_token_id]) for p in prompts]
    for _ in range(30):
        learner.forward_backward(batch, "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    worker.update_weights(learner.weights())
    stops = worker.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), 1)
    assert all(r.samples[0].token_ids == [tokenizer.eos_token_id] for r in stops)
    full = worker.generate(prompts, SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True), 2)
    assert all(len(s.token_ids) == 5 and s.finish_reason is FinishReason.LENGTH for r in full for s in r.samples)


def test_a_stop_callback_ends_every_row_early_and_a_call_stopped_before_it_began_samples_nothing(worker, prompts):
    """``generate(stop=...)`` (the Tinker learner's abandoned sampling call, ``cancel_future``): asked between
    tokens, and once it says True every row ends where it is, its tokens and logprobs kept in step."""
    if worker.backend.name == "vllm":
        pytest.skip("the vLLM backend takes no stop callback: a cancelled request's vLLM call runs to its end")
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3

    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, seed=1)
    cut = [s for r in worker.backend.generate(prompts, params, 2, stop=stop) for s in r]
    assert len(cut) == 4 and len({len(s.token_ids) for s in cut}) == 1  # every row cut at the same step
    assert 0 < len(cut[0].token_ids) < 200 and all(len(s.logprobs) == len(s.token_ids) for s in cut)
    assert all(s.finish_reason is FinishReason.LENGTH for s in cut)
    never = worker.backend.generate(prompts, params, 2, stop=lambda: True)
    assert [[s.token_ids for s in r] for r in never] == [[[], []], [[], []]]


def test_min_p_rules_out_every_token_under_its_share_of_the_likeliest_after_temperature(worker, tiny_path, prompts):
    """min-p after temperature T keeps a token only where p_T >= min_p * max p_T, i.e. where its raw logprob
    is at least T * log(min_p) below the likeliest token's; the recorded logprobs stay the raw ones."""
    import math

    from otray.models import load_model

    worker.update_weights(PolicyLearner(tiny_path).weights())  # the base weights, as ``model`` holds them
    model = load_model(tiny_path)

    def worst_gap(min_p: float) -> float:
        """The largest (likeliest raw logprob - sampled token's raw logprob) over every sampled token."""
        params = SamplingParams(max_tokens=24, temperature=2.0, min_p=min_p, ignore_eos=True, seed=5)
        gaps = []
        for prompt, result in zip(prompts, worker.generate(prompts, params, n=4)):
            for s in result.samples:
                with torch.no_grad():
                    lp = model(torch.tensor([prompt + s.token_ids])).logits[0].float().log_softmax(-1)
                steps = lp[len(prompt) - 1:len(prompt) - 1 + len(s.token_ids)]
                chosen = steps.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
                assert torch.allclose(chosen, torch.tensor(s.logprobs), atol=1e-3)  # raw logprobs recorded
                gaps.extend((steps.max(-1).values - chosen).tolist())
        return max(gaps)

    bound = -2.0 * math.log(0.6)  # 1.02 nats (the untrained tiny model's distributions are flat)
    assert worst_gap(0.0) > bound  # without min-p, a temperature of 2 samples further down
    assert worst_gap(0.6) <= bound + 1e-3


def test_chosen_logprobs_hold_one_step_and_equal_the_raw_log_softmax():
    """The HF sampler records each chosen token's raw logprob step by step (the processor sees the
    scores before temperature/top-k/top-p), holding one step's log-softmax, never every step's logits."""
    import torch

    from otray.actors.sampling.backends.hf_logits import ChosenLogprobs

    torch.manual_seed(0)
    steps = [torch.randn(3, 11) for _ in range(4)]
    chosen = torch.randint(0, 11, (3, 4))
    rec = ChosenLogprobs()
    prompt = torch.zeros(3, 2, dtype=torch.long)
    for k, scores in enumerate(steps):
        ids = torch.cat([prompt, chosen[:, :k]], dim=1)
        assert rec(ids, scores) is scores  # the scores pass on unchanged
        assert len(rec.chosen) == max(0, k)  # only the steps decided so far, one log-softmax held
    got = rec.finish(chosen)
    want = torch.stack([s.log_softmax(-1).gather(-1, chosen[:, k:k + 1]).squeeze(-1) for k, s in enumerate(steps)], 1)
    assert torch.allclose(got, want)


def test_vllm_engine_settings_follow_the_device():
    """dtype ``auto`` and eager mode resolved where the engine runs: here (no GPU) float32 and eager,
    the engine in the caller's process; an explicit choice is kept."""
    from otray.actors.sampling.backends.vllm import engine_settings

    assert engine_settings("auto", None) == {"dtype": "float32", "enforce_eager": True, "in_process": True}
    assert engine_settings("bfloat16", False) == {"dtype": "bfloat16", "enforce_eager": False, "in_process": True}

