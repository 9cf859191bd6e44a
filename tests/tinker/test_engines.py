"""The Tinker service's vLLM sampler (the CPU build here): sampler checkpoints of many clients as
LoRA adapters of one engine, driven by the real ``tinker`` SDK over HTTP.

Three base models share the tiny weights: ``Qwen/Qwen3-8B`` samples on vLLM; ``fallback`` gives its
sampler a GPU this cluster lacks, under ``auto``, and so samples on its learner; ``strict`` asks for
the same under ``vllm`` and gets an error that says why.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import ROOT, SERVE_PORT, tinker_service
from tests.fixtures.tinker_data import problems, sft

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"
CALL = 4  # samples per vLLM call at most (sample_call_max_samples), taken in turns over users


@pytest.fixture(scope="module")
def svc(ray_local, tmp_path_factory, tiny_path):
    pytest.importorskip("vllm")
    unplaceable = {"gpus": 1, "start_timeout_s": 3}  # auto tries vLLM only for a sampler with a GPU
    models = [{"name": BASE, "path": tiny_path, "sampler": {"engine": "vllm", "max_lora_rank": 8}},
              {"name": "fallback", "path": tiny_path, "learner_cpus": 0.5, "sampler": {"engine": "auto", **unplaceable}},
              {"name": "strict", "path": tiny_path, "learner_cpus": 0.5, "sampler": {"engine": "vllm", **unplaceable}}]
    keys, stop = tinker_service(ray_local, tmp_path_factory.mktemp("tinker-vllm"), PORT, tiny_path, models=models,
                                sample_call_max_samples=CALL)
    yield keys
    stop()


def engines(ray_local) -> dict:
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    return ray_local.get(ray_local.get_actor(NAME, namespace=NAMESPACE).sample_engines.remote())


def forward_logprobs(tc, prompt: list[int], tokens: list[int]) -> list[float]:
    """The training client's logprobs of ``tokens`` after ``prompt`` (its current weights)."""
    seq = prompt + tokens
    d = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(seq) - 1)})
    return tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1:]


def train(tc, tokenizer, steps: int, seed: int) -> None:
    for s in range(steps):
        tc.forward_backward([sft(p, a) for p, a in problems(tokenizer, 4, seed + s)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


@pytest.mark.vllm
def test_sampler_checkpoints_of_two_clients_and_the_base_sample_on_one_vllm_engine(svc, tokenizer, ray_local, tiny_path):
    import torch

    from otray.models import load_model

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    # vLLM has no LoRA on the unembedding: the first client's adapter is servable, the second's is not
    fast = sc.create_lora_training_client(base_model=BASE, rank=8, seed=1, train_unembed=False).result()
    slow = sc.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    other = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3, train_unembed=False).result()
    for i, tc in enumerate((fast, slow, other)):
        train(tc, tokenizer, 2, 10 * i)
    samplers = [sc.create_sampling_client(model_path=tc.save_weights_for_sampler("v").result().path).result()
                for tc in (fast, slow, other)]
    base = sc.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))
    params = types.SamplingParams(max_tokens=6, seed=1, temperature=1.0)
    pending = [s.sample(prompt, 2, params) for s in (*samplers, base)]  # sent together: one batch
    results = [p.result() for p in pending]
    served = engines(ray_local)
    assert served["vllm"] == 3 and served["learner"] == 1, served  # fast, other and the base on vLLM
    # what vLLM sampled has the logprobs the trained adapters give it (one engine, two adapters, no mixing)
    for tc, res in [(fast, results[0]), (other, results[2]), (slow, results[1])]:
        for seq in res.sequences:
            assert 1 <= len(seq.tokens) <= 6
            assert np.allclose(seq.logprobs, forward_logprobs(tc, prompt.to_ints(), seq.tokens), atol=2e-4)
    assert results[0].sequences[0].logprobs != results[2].sequences[0].logprobs
    # the base model's samples (sent in the same batch) have the untrained model's logprobs
    model = load_model(tiny_path, "float32")
    for seq in results[3].sequences:
        ids = torch.tensor([prompt.to_ints() + list(seq.tokens)])
        with torch.no_grad():
            lp = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        assert np.allclose(seq.logprobs, lp[prompt.length - 1:].tolist(), atol=2e-4)
    # prompt logprobs on vLLM, and stop ids and strings keep the prefix up to the stop
    full = samplers[0].compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + results[0].sequences[0].tokens)).result()
    assert full[0] is None and np.allclose(full[prompt.length:], results[0].sequences[0].logprobs, atol=2e-4)
    first = samplers[0].sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=5)).result().sequences[0].tokens
    k = next(i for i in range(1, len(first)) if first[i] not in first[:i])
    by_id = samplers[0].sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=5, stop=[first[k]])).result()
    assert by_id.sequences[0].tokens == first[:k + 1] and by_id.sequences[0].stop_reason == "stop"
    text = tokenizer.decode(first[:k + 1])
    by_str = samplers[0].sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=5, stop=[text])).result()
    assert tokenizer.decode(by_str.sequences[0].tokens).endswith(text) and by_str.sequences[0].stop_reason == "stop"
    # a checkpoint written again under its name (save_state with overwrite) is sampled as it is now
    path = fast.save_state("w").result().path
    old = sc.create_sampling_client(model_path=path).result()
    before = old.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + first)).result()[prompt.length:]
    train(fast, tokenizer, 1, 100)
    assert fast.save_state("w", overwrite=True).result().path == path
    lps = old.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + first)).result()[prompt.length:]
    assert np.allclose(lps, forward_logprobs(fast, prompt.to_ints(), first), atol=2e-4)
    assert not np.allclose(lps, before, atol=1e-3)
    assert engines(ray_local)["vllm"] > served["vllm"]
    # an engine that dies fails the requests it held with the reason; the next request starts a new one
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    ray_local.kill(ray_local.get_actor(f"{NAME}-sampler-{BASE}", namespace=NAMESPACE))
    with pytest.raises(Exception, match="the vllm sampler died.*a new engine is started"):
        samplers[0].sample(prompt, 1, params).result()
    assert len(samplers[0].sample(prompt, 2, params).result().sequences) == 2
    sc.close("success").result()


@pytest.mark.vllm
def test_a_users_flood_goes_to_vllm_in_calls_and_another_users_request_in_the_first(svc, tokenizer, ray_local):
    """sample_call_max_samples: alice's 8 requests of 2 samples go out in calls of at most CALL samples; bob's
    request, sent after them, is taken in the first turn of the next call, not after the flood."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    prompt = types.ModelInput.from_ints(problems(tokenizer, 1)[0][0][:4])
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    alice = tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).create_sampling_client(base_model=BASE).result()
    bob = tinker.ServiceClient(base_url=URL, api_key=svc["bob"]).create_sampling_client(base_model=BASE).result()
    before = len(ray_local.get(ray_local.get_actor(NAME, namespace=NAMESPACE).sample_calls.remote()))
    flood = [alice.sample(prompt, 2, params) for _ in range(8)]
    mine = bob.sample(prompt, 1, params)
    for i, f in enumerate([mine, *flood]):
        assert len(f.result(timeout=120).sequences) == (1 if i == 0 else 2)
    calls = ray_local.get(ray_local.get_actor(NAME, namespace=NAMESPACE).sample_calls.remote())[before:]
    assert len(calls) >= 4 and max(calls) <= 3, calls  # 17 samples in calls of 4: (2 + 1 + 2) or (2 + 2)
    assert engines(ray_local)["vllm"] >= 9


def test_prompt_cache_hit_tokens_come_from_vllms_prefix_cache(svc, tokenizer):
    """``prompt_cache_hit_tokens``: 0 for a prompt the engine has not seen; when the same long prompt comes
    again, the prompt tokens vLLM's prefix cache held (whole cache blocks, fewer than the prompt). The
    learner's HF sampler has no prefix cache: always 0 there."""
    prompt = types.ModelInput.from_ints([int(t) for t in np.random.default_rng(7).integers(10, 400, 300)])
    params = types.SamplingParams(max_tokens=2, temperature=1.0)
    first = tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).create_sampling_client(base_model=BASE).result()
    assert first.sample(prompt, 1, params).result(timeout=120).prompt_cache_hit_tokens == 0
    again = first.sample(prompt, 2, params).result(timeout=120).prompt_cache_hit_tokens
    assert 0 < again < 300, again
    learner = tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).create_sampling_client(base_model="fallback").result()
    for _ in range(2):
        assert learner.sample(prompt, 1, params).result(timeout=120).prompt_cache_hit_tokens == 0


def test_an_engine_that_cannot_start_falls_back_under_auto_and_is_an_error_under_vllm(svc, tokenizer, ray_local):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    prompt = types.ModelInput.from_ints(tokenizer.encode("1+2="))
    before = engines(ray_local)["learner"]
    res = sc.create_sampling_client(base_model="fallback").result().sample(prompt, 2, types.SamplingParams(max_tokens=3))
    assert len(res.result().sequences) == 2
    served = engines(ray_local)
    assert served["learner"] == before + 1 and "did not start within 3 s" in served["down"]["fallback"]
    strict = sc.create_sampling_client(base_model="strict").result()
    with pytest.raises(Exception, match=r"vLLM sampler of strict did not start.*sampler.engine: learner"):
        strict.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result()
    sc.close("success").result()


def test_sampler_config_errors_name_the_key_and_the_shipped_configs_load():
    from otray.tinker.config import load_tinker
    from otray.types import ConfigError

    shipped = sorted((ROOT / "conf" / "tinker").glob("*.yaml"))
    assert shipped and all(load_tinker(p).models[0].sampler.gpus > 0 for p in shipped)

    with pytest.raises(ConfigError, match=r"models\[0\].sampler.engine='gpu' is not valid; choose one of auto, vllm"):
        load_tinker({"models": [{"sampler": {"engine": "gpu"}}]})
    with pytest.raises(ConfigError, match=r"models\[0\].sampler.max_loras must be >= 1, got 0"):
        load_tinker({"models": [{"sampler": {"max_loras": 0}}]})


def test_quotas_load_with_per_user_exceptions_and_bad_values_are_named():
    from otray.tinker.config import load_tinker, quota_of
    from otray.types import ConfigError

    cfg = load_tinker({"quota": {"training_clients": 4}, "user_quotas": {"bob": {"lora_rank": 64}}})
    assert (quota_of(cfg, "alice").training_clients, quota_of(cfg, "alice").lora_rank) == (4, 1024)
    assert (quota_of(cfg, "bob").training_clients, quota_of(cfg, "bob").lora_rank) == (16, 64)  # his own, whole
    with pytest.raises(ConfigError, match=r"user_quotas.bob.training_clients must be >= 0, got -1"):
        load_tinker({"user_quotas": {"bob": {"training_clients": -1}}})
