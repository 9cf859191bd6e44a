"""On a GPU (marked ``gpu``; skipped without CUDA): learner and sampler on CUDA, their logprob gap in bf16
and float32, full and LoRA weight updates reaching the sampler. Run on a lent GPU machine with
``python -m pytest -q tests/test_gpu.py`` (see NOTES.md, issue 18)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _gap(learner, sampler, tokenizer) -> float:
    from otray.algos.datums import sft_datum
    from otray.models import chat_prompt_ids
    from otray.types import SamplingParams

    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "12+34="}])
    sample = sampler.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True), 1)[0][0]
    lp = learner.forward([sft_datum(prompt, sample.token_ids)])[0][-len(sample.token_ids):]
    return max(abs(a - b) for a, b in zip(lp, sample.logprobs))


@pytest.mark.parametrize("dtype, bound", [("bfloat16", 2e-2), ("float32", 1e-3)])
@pytest.mark.parametrize("rank", [0, 8])
def test_learner_and_sampler_on_cuda_agree_before_and_after_an_update(tiny_path, tokenizer, dtype, bound, rank):
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.algos.datums import sft_datum

    learner = PolicyLearner(tiny_path, device="cuda", dtype=dtype, lora={"rank": rank, "alpha": 16})
    sampler = HFBackend(tiny_path, device="cuda", dtype=dtype)
    assert next(learner.model.parameters()).device.type == "cuda" and sampler.model.device.type == "cuda"
    update = learner.weights()
    (sampler.load_lora(update.tensors, update.lora_config, update.version) if rank
     else sampler.load_full_weights(update.tensors))
    assert _gap(learner, sampler, tokenizer) < bound
    batch = [sft_datum([5, 6, 7, 8], [9, 10, 11])] * 4
    for _ in range(3):
        learner.forward_backward(batch, "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    moved = _gap(learner, sampler, tokenizer)
    update = learner.weights()
    (sampler.load_lora(update.tensors, update.lora_config, update.version) if rank
     else sampler.load_full_weights(update.tensors))
    assert _gap(learner, sampler, tokenizer) < bound < moved  # the update reached the sampler
