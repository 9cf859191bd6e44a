"""Learner and rollout workers as Ray actors: weights travel by object reference."""

import pytest

from otray.actors.learner.policy_learner import PolicyLearner
from otray.actors.sampling.rollout import RolloutWorker
from otray.actors.sampling.fleet import RolloutFleet
from otray.algos.datums import sft_datum
from otray.models import chat_prompt_ids
from otray.types import Datum, RolloutError, SamplingParams


def test_full_and_lora_sync_through_the_object_store(ray_local, tiny_path, tokenizer):
    ray = ray_local
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "3+4="}])
    target = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]
    for lora in ({"rank": 0}, {"rank": 8}):
        learner = ray.remote(PolicyLearner).remote(tiny_path, lora=lora)
        worker = ray.remote(RolloutWorker).remote(tiny_path, "hf", max_model_len=128)
        for _ in range(30):
            learner.forward_backward.remote([sft_datum(prompt, target)], "cross_entropy")
            learner.optim_step.remote(learning_rate=2e-2)
        ref = learner.weights.remote()  # an ObjectRef: the worker fetches it from the object store
        assert ray.get(worker.update_weights.remote(ref)) == 30
        out = ray.get(worker.generate.remote([prompt], SamplingParams(max_tokens=4, temperature=0.0), 1))[0]
        assert out.policy_version == 30
        sample = out.samples[0]
        seq = prompt + sample.token_ids
        n = len(seq) - 1
        lp = ray.get(learner.forward.remote([Datum(seq[:-1], seq[1:], [0.0] * n, [0.0] * n, [0.0] * n)]))[0]
        diffs = [abs(a - b) for a, b in zip(lp[len(prompt) - 1:], sample.logprobs)]
        assert sum(diffs) / len(diffs) < 1e-3, (lora, diffs)
        if lora["rank"] == 0:
            assert sample.token_ids == target
        ray.kill(worker)
        ray.kill(learner)


def test_fleet_routes_around_a_dead_worker(ray_local, tiny_path, tokenizer):
    ray = ray_local
    workers = [ray.remote(RolloutWorker).remote(tiny_path, "hf", max_model_len=128) for _ in range(2)]
    fleet = RolloutFleet(workers)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": f"{i}+1="}]) for i in range(6)]
    params = SamplingParams(max_tokens=3, temperature=1.0)
    assert len(fleet.generate(prompts, params)) == 6

    @ray.remote
    class Source:  # stands in for a learner that dies while it builds the update
        def weights(self):
            import time
            time.sleep(60)

    source = Source.remote()
    update = source.weights.remote()
    ray.kill(source)
    with pytest.raises(ray.exceptions.RayActorError):  # the source's death, not the workers'
        fleet.update_weights(update)
    assert fleet.dead == {}
    ray.kill(workers[0])
    results = fleet.generate(prompts, params)
    assert len(results) == 6 and all(r.samples for r in results)
    assert list(fleet.dead) == [0] and "Actor" in fleet.dead[0]
    ray.kill(workers[1])
    with pytest.raises(RolloutError, match="every rollout worker failed: worker 0: .*; worker 1: "):
        fleet.generate(prompts, params)
