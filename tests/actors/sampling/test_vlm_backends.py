"""The tiny VLM behind a RolloutWorker on both backends (vLLM's CPU build included): image prompts sampled
with logprobs within the text path's tolerance of the learner's, full and LoRA updates reaching the sampler
(the vision tower's weights included), and an image for a text-only worker refused by name."""

from __future__ import annotations

import pytest

from envs.shapes import draw, scene
from otray.actors.learner.policy_learner import PolicyLearner
from otray.actors.sampling.backends.vllm import torchvision_loads
from otray.actors.sampling.rollout import RolloutWorker
from otray.algos.datums import sft_datum
from otray.models import LoraSpec
from otray.types import Datum, SamplingParams
from otray.vlm import observation_prompt

BACKENDS = ["hf", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module", params=BACKENDS)
def worker(request, vl_path):
    if request.param == "vllm" and not torchvision_loads():
        pytest.skip("vLLM's Qwen2-VL needs torchvision, which does not load here (see torchvision_loads)")
    w = RolloutWorker(vl_path, request.param, max_model_len=128, max_lora_rank=8, seed=0)
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def shown(worker, vl_path):
    """Three pictures and their prompts (the chat template's, each image widened to its 4 tokens)."""
    pictures = [draw(scene(s)[1]) for s in range(3)]
    return [(observation_prompt(worker.backend.tokenizer, [], [p, "How many shapes?"])[0], (p,)) for p in pictures]


def gaps(worker, learner, shown, n=3) -> list[float]:
    """Mean |sampler - learner| logprob over each sample's tokens, for ``n`` samples of every prompt."""
    results = worker.generate([p for p, _ in shown], SamplingParams(max_tokens=10, temperature=1.0, seed=3), n,
                              [im for _, im in shown])
    out = []
    for (prompt, images), r in zip(shown, results):
        for s in r.samples:
            seq = prompt + s.token_ids
            k = len(seq) - 1
            lp = learner.forward([Datum(seq[:-1], seq[1:], [0.0] * k, [0.0] * k, [0.0] * k, images=images)])[0]
            lp = lp[len(prompt) - 1:]
            out.append(sum(abs(a - b) for a, b in zip(lp, s.logprobs)) / len(lp))
    return out


def test_image_prompts_sample_as_the_learner_scores(worker, vl_path, shown):
    learner = PolicyLearner(vl_path)
    worker.update_weights(learner.weights())
    assert max(gaps(worker, learner, shown)) < 1e-3
    pad = learner.model.config.image_token_id
    results = worker.generate([p for p, _ in shown], SamplingParams(max_tokens=10, seed=5), 4, [im for _, im in shown])
    assert all(pad not in s.token_ids for r in results for s in r.samples)  # vision tokens are never sampled


def test_full_and_lora_updates_reach_the_sampler(worker, vl_path, shown):
    learner = PolicyLearner(vl_path)
    batch = [sft_datum(p, worker.backend.tokenizer.encode(str(scene(s)[0]) + "<|im_end|>", add_special_tokens=False),
                       im) for s, (p, im) in enumerate(shown)]
    for _ in range(30):
        learner.forward_backward(batch, "cross_entropy")
        learner.optim_step(learning_rate=1e-2)
    assert min(gaps(worker, learner, shown, n=1)) > 1e-2  # the worker still samples the base weights
    worker.update_weights(learner.weights())
    assert max(gaps(worker, learner, shown)) < 1e-3

    worker.update_weights(PolicyLearner(vl_path).weights())  # back to the base weights the adapter is made on
    lora = PolicyLearner(vl_path, lora=LoraSpec(rank=8))
    for _ in range(30):
        lora.forward_backward(batch, "cross_entropy")
        lora.optim_step(learning_rate=2e-2)
    assert min(gaps(worker, lora, shown, n=1)) > 1e-2
    worker.update_weights(lora.weights())
    assert max(gaps(worker, lora, shown)) < 1e-3


def test_images_for_a_text_worker_are_refused(tiny_path, shown):
    from otray.vision import ImageError

    text = RolloutWorker(tiny_path, "hf", max_model_len=128)
    with pytest.raises(ImageError, match="takes no images"):
        text.generate([shown[0][0]], SamplingParams(max_tokens=2), 1, [shown[0][1]])


def test_the_hf_samplers_vision_tower_runs_once_per_distinct_image(worker, shown):
    """n samples of a prompt, another prompt with the same picture, and the next call with it (an episode's
    next turn) run the HF sampler's vision tower once per distinct picture (vLLM keeps its own encoder
    cache); a weight update empties the cache (the update tests above check the features follow it)."""
    if worker.backend.name != "hf":
        pytest.skip("the HF backend's cache (vLLM caches encoder outputs itself)")
    cache = worker.backend.features
    cache.clear()
    runs, hits = cache.runs, cache.hits
    prompts = [shown[0], shown[1], shown[0]]
    first = worker.generate([p for p, _ in prompts], SamplingParams(max_tokens=4, temperature=0.0), 4,
                            [im for _, im in prompts])
    assert cache.runs - runs == 2 and cache.hits - hits >= 10  # 12 rows, 2 pictures
    again = worker.generate([shown[0][0]], SamplingParams(max_tokens=4, temperature=0.0), 1, [shown[0][1]])
    assert cache.runs - runs == 2  # the next turn: from the cache, and the same greedy answer
    assert again[0].samples[0].token_ids == first[0].samples[0].token_ids
    assert again[0].samples[0].logprobs == pytest.approx(first[0].samples[0].logprobs, abs=1e-5)
    worker.update_weights(PolicyLearner(worker.backend.model.config._name_or_path).weights())
    assert not cache.items
