"""The Tinker API, driven by the real ``tinker`` SDK (0.38.0) over HTTP against ``otray tinker``
on a local Ray, with auth on (two users). Reference numbers come from an in-process
AdapterLearner fed the same data in one call."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import numpy as np
import pytest

from tests.conftest import SERVE_PORT, tinker_fixture
from tests.fixtures.tinker_data import problems, sft, to_otray

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
CHUNK = 3  # datums per forward_backward request: an 8-datum call goes out as 3 parallel chunks
SLICE = 16  # tokens per learner call (scheduling.slice_tokens): a 3-datum chunk of ~8-token datums is 2 slices
BOB_QUOTA = {"training_clients": 2, "lora_rank": 10}  # an admin's exceptions (alice: the default)
CAROL_QUOTA = {"samplers": 1, "concurrent_requests": 3, "storage_gb": 1e-6}


svc = tinker_fixture(PORT, "tinker", max_chunk_datums=CHUNK, user_quotas={"bob": BOB_QUOTA, "carol": CAROL_QUOTA},
                     scheduling={"slice_tokens": SLICE})


BASE = "Qwen/Qwen3-8B"  # a registry name, mapped to the tiny model by the service config


def adapter_file(store: Path, model_id: str, name: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    hits = list(store.glob(f"checkpoints/*/{model_id.replace(':', '_')}/weights/{name}/adapter_model.safetensors"))
    assert len(hits) == 1, hits
    return load_file(str(hits[0]))


def reference(tiny_path: str, steps: list[list], rank: int, seed: int, lr: float):
    """An in-process AdapterLearner trained on ``steps`` (one forward_backward call per step)."""
    from otray.tinker.learner.adapter_learner import AdapterLearner
    from otray.tinker.learner.specs import AdamStep, AdapterSpec

    ref = AdapterLearner(tiny_path)
    ref.create("ref", AdapterSpec(rank, seed))
    for data in steps:
        ref.forward_backward("ref", [to_otray(d) for d in data], "cross_entropy")
        ref.optim_step("ref", AdamStep(learning_rate=lr))
    return {k: v.numpy() for k, v in ref.adapter_tensors("ref").items()}


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    def norm(k: str) -> str:  # PEFT names the adapter in its tensors' keys only in memory
        return k.replace(".ref.", ".").replace("base_model.model.", "")

    a2, b2 = {norm(k): v for k, v in a.items()}, {norm(k): v for k, v in b.items()}
    assert sorted(a2) == sorted(b2), (sorted(a2)[:3], sorted(b2)[:3])
    return max(float(np.abs(a2[k] - b2[k]).max()) for k in a2)


def test_training_sampling_and_checkpoint_calls_through_the_sdk(svc, tokenizer):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    caps = tinker.RestClient(base_url=URL, api_key=svc["alice"]).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    assert tc.get_info().lora_rank == 4 and tc.get_tokenizer().encode("12+3") == tokenizer.encode("12+3")
    data = [sft(p, a) for p, a in problems(tokenizer, 8)]
    fwd = tc.forward(data, "cross_entropy").result()
    fb = tc.forward_backward(data, "cross_entropy").result()
    assert len(fb.loss_fn_outputs) == 8  # 3 chunks, put back in order
    for d, out in zip(data, fb.loss_fn_outputs):
        assert out["logprobs"].shape == [d.model_input.length]
    # forward is the same pass without a gradient; the loss is the sum of -weight * logprob
    assert np.allclose(fwd.loss_fn_outputs[5]["logprobs"].tolist(), fb.loss_fn_outputs[5]["logprobs"].tolist(), atol=1e-5)
    total = sum(-np.dot(o["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()) for d, o in zip(data, fb.loss_fn_outputs))
    assert fb.metrics["loss:sum"] == pytest.approx(total, rel=1e-4)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["step:max"] == 1
    # policy losses take sampler logprobs and advantages with Tinker's names
    rl = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": o["logprobs"],
        "advantages": np.full(d.model_input.length, 0.5, dtype=np.float32)}) for d, o in zip(data, fb.loss_fn_outputs)]
    for loss, config in [("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                         ("cispo", None), ("dro", {"beta": 0.05})]:
        assert np.isfinite(tc.forward_backward(rl, loss, config).result().metrics["loss:sum"])
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # sampling: named sampler weights, n samples, stop strings and ids, prompt logprobs
    saved = tc.save_weights_for_sampler("s1").result()
    assert saved.path.endswith("/sampler_weights/s1")
    sampler = sc.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))
    res = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=1)).result()
    assert len(res.sequences) == 3 and all(1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens)
                                           for s in res.sequences)
    assert len({s.sequence_id for s in res.sequences}) == 3
    # a fixed seed and shape repeat a sample; stopping at its (k+1)-th token keeps exactly that prefix
    first = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=5, stop=[])).result().sequences[0].tokens
    k = next(i for i in range(1, len(first)) if first[i] not in first[:i])
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=5, stop=[first[k]])).result()
    assert by_id.sequences[0].tokens == first[:k + 1] and by_id.sequences[0].stop_reason == "stop"
    text = tokenizer.decode(first[:k + 1])
    by_str = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=5, stop=[text])).result()
    assert tokenizer.decode(by_str.sequences[0].tokens).endswith(text) and by_str.sequences[0].stop_reason == "stop"
    lps = sampler.compute_logprobs(prompt).result()
    assert lps[0] is None and len(lps) == prompt.length and all(v < 0 for v in lps[1:])
    # the sampled tokens' logprobs are what the trained model gives them
    seq = res.sequences[1]
    full = sampler.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + seq.tokens)).result()
    assert np.allclose(full[prompt.length:], seq.logprobs, atol=1e-4)
    # ephemeral sampler weights, then the base model
    eph = tc.save_weights_and_get_sampling_client().result()
    assert len(eph.sample(prompt, 2, types.SamplingParams(max_tokens=4)).result().sequences) == 2
    base = sc.create_sampling_client(base_model=BASE).result()
    assert base.compute_logprobs(prompt).result() != lps
    # checkpoints: save, list, info, delete
    st = tc.save_state("st1").result()
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    ids = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert ids == ["sampler_weights/s1", "weights/st1"]
    run = rest.get_training_run(tc.model_id).result()
    assert run.lora_rank == 4 and run.last_checkpoint.tinker_path == st.path and run.model_owner == "alice"
    assert rest.get_weights_info_by_tinker_path(st.path).result().lora_rank == 4
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    handle = json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))
    assert rest.get_sampler(handle["sampling_session_id"]).result().base_model == BASE
    rest.delete_checkpoint(tc.model_id, "weights/st1").result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["sampler_weights/s1"]
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_training_client_from_state(st.path).result()
    sc.close("success").result()


def test_chunks_pipelining_and_resume_match_one_call_in_process(svc, tokenizer, tiny_path, ray_local):
    """8 datums go out as 3 parallel chunks, each in 2 learner slices; fb, optim, fb, optim are all submitted
    before any is awaited, so a last chunk finds its optim_step queued and both go to the learner as one call
    (train_runs.pass_and_step); the adapter equals one trained in process with one call per step. A client made
    from the saved state (with optimizer) then takes the same next step as the original."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    actor = ray_local.get_actor(NAME, namespace=NAMESPACE)
    joined = ray_local.get(actor.learner_use.remote())[BASE]["train_steps"]
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=11).result()
    steps = [[sft(p, a) for p, a in problems(tokenizer, 8, seed=s)] for s in range(3)]
    futures = []
    for data in steps[:2]:
        futures += [tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=5e-3))]
    losses = [f.result().metrics["loss:sum"] for f in futures[::2]]
    assert losses[1] != losses[0]
    assert [f.result().metrics["step:max"] for f in futures[1::2]] == [1.0, 2.0]
    assert ray_local.get(actor.learner_use.remote())[BASE]["train_steps"] > joined  # a pair went as one call
    state = tc.save_state("two", ).result()
    assert max_diff(adapter_file(svc["store"], tc.model_id, "two"), reference(tiny_path, steps[:2], 8, 11, 5e-3)) < 1e-5
    # resume: the original and a client made from its state take the same third step
    resumed = sc.create_training_client_from_state_with_optimizer(state.path).result()
    for client, name in ((tc, "three-a"), (resumed, "three-b")):
        client.forward_backward(steps[2], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-3))
        client.save_state(name).result()
    a = adapter_file(svc["store"], tc.model_id, "three-a")
    b = adapter_file(svc["store"], resumed.model_id, "three-b")
    assert max_diff(a, b) == 0.0
    # weights only (no optimizer state) is a different third step
    fresh = sc.create_training_client_from_state(state.path).result()
    fresh.forward_backward(steps[2], "cross_entropy")
    fresh.optim_step(types.AdamParams(learning_rate=5e-3))
    fresh.save_state("three-c").result()
    assert max_diff(a, adapter_file(svc["store"], fresh.model_id, "three-c")) > 1e-4
    sc.close("success").result()


def test_a_forward_backward_reaches_the_learner_as_slices_in_the_users_turns(svc, tokenizer, ray_local):
    """A 3-datum request of 8-token datums is two learner steps at SLICE=16 tokens, counted as alice's
    (the adapter equality above shows the slices add up to one call)."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    actor = ray_local.get_actor(NAME, namespace=NAMESPACE)

    def steps(user: str) -> int:
        return ray_local.get(actor.learner_use.remote())[BASE]["steps"].get(user, 0)

    tc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).create_lora_training_client(base_model=BASE, rank=2)
    tc = tc.result()
    data = [sft(p, a) for p, a in problems(tokenizer, 3, seed=9)]
    assert [d.model_input.length for d in data] == [8, 8, 8]
    before, bob = steps("alice"), steps("bob")
    assert len(tc.forward_backward(data, "cross_entropy").result().loss_fn_outputs) == 3
    assert steps("alice") - before == 2 and steps("bob") == bob


def test_async_calls(svc, tokenizer):
    async def main():
        sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
        tc = await sc.create_lora_training_client(base_model=BASE, rank=2)
        data = [sft(p, a) for p, a in problems(tokenizer, 4, seed=7)]
        fb = await tc.forward_backward(data, "cross_entropy")
        opt = await tc.optim_step(types.AdamParams(learning_rate=1e-3))
        sampler = await tc.save_weights_and_get_sampling_client(name="a1")
        prompt = types.ModelInput.from_ints(tokenizer.encode("3+4="))
        outs = await asyncio.gather(*[sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3)) for _ in range(4)])
        lps = await sampler.compute_logprobs(prompt)
        saved = await tc.save_state("a2")
        loaded = await sc.create_training_client_from_state(saved.path)
        await sc.close("success")
        return fb, opt, outs, lps, loaded

    fb, opt, outs, lps, loaded = asyncio.run(main())
    assert len(fb.loss_fn_outputs) == 4 and opt.metrics["step:max"] == 1
    assert [len(o.sequences) for o in outs] == [2, 2, 2, 2] and lps[0] is None and loaded.model_id.endswith(":train:1")


def test_two_users_train_concurrently_and_each_adapter_equals_it_trained_alone(svc, tokenizer, tiny_path):
    data = {4: [[sft(p, a) for p, a in problems(tokenizer, 4, seed=100 + s)] for s in range(5)],
            8: [[sft(p, a) for p, a in problems(tokenizer, 4, seed=200 + s)] for s in range(5)]}

    def train(key: str, rank: int) -> tuple[str, str]:
        sc = tinker.ServiceClient(base_url=URL, api_key=key)
        tc = sc.create_lora_training_client(base_model=BASE, rank=rank, seed=rank).result()
        for batch in data[rank]:
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2))
        path = tc.save_state("five").result().path
        tc.save_weights_for_sampler("five-s").result()
        sc.close("success").result()  # else its heartbeat thread outlives the test
        return tc.model_id, path

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        (ma, pa), (mb, pb) = pool.map(train, [svc["alice"], svc["bob"]], [4, 8])
    for model_id, rank in ((ma, 4), (mb, 8)):
        assert max_diff(adapter_file(svc["store"], model_id, "five"),
                        reference(tiny_path, data[rank], rank, rank, 1e-2)) < 1e-5
    # bob cannot see, sample from, load or delete alice's checkpoints
    bob = tinker.ServiceClient(base_url=URL, api_key=svc["bob"])
    bob_rest = tinker.RestClient(base_url=URL, api_key=svc["bob"])
    for attempt in (lambda: bob.create_sampling_client(model_path=pa.replace("/weights/five", "/sampler_weights/five-s")).result(),
                    lambda: bob.create_training_client_from_state(pa).result(),
                    lambda: bob_rest.delete_checkpoint(ma, "weights/five").result(),
                    lambda: bob_rest.list_checkpoints(ma).result()):
        with pytest.raises(Exception, match="404|no checkpoint|no training run"):
            attempt()
    alice_rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    assert "weights/five" in [c.checkpoint_id for c in alice_rest.list_checkpoints(ma).result().checkpoints]
    bob.close("success").result()


def test_bad_input_gets_a_user_error_or_a_4xx_never_a_5xx_or_a_hang(svc, tokenizer):
    import httpx

    from tinker.proto import tinker_public_pb2 as pb

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    headers = {"X-API-Key": svc["alice"], "Content-Type": "application/x-protobuf"}
    t0 = time.time()
    r = httpx.post(f"{URL}/api/v1/forward_backward", content=b"\x0a\xff\xff garbage", headers=headers)
    assert r.status_code == 400 and "protobuf" in r.json()["detail"]
    msg = pb.ForwardBackwardRequest(model_id="s-nope:train:0", seq_id=1, loss_fn="cross_entropy")
    r = httpx.post(f"{URL}/api/v1/forward_backward", content=msg.SerializeToString(), headers=headers)
    assert r.status_code == 404 and "no training run" in r.json()["detail"]
    r = httpx.post(f"{URL}/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 1}, headers={"X-API-Key": "tml-9_wrong"})
    assert r.status_code == 401
    r = httpx.post(f"{URL}/api/v1/retrieve_future", json={"request_id": "x"}, headers=headers)
    assert r.status_code == 404
    # wrong JSON types and shapes are named at the route (they used to reach SQLite or str methods: 500s)
    for route, body, says in (("get_info", {"model_id": [1]}, "model_id must be a string"),
                              ("weights_info", {"tinker_path": {}}, "tinker_path must be a string"),
                              ("save_weights_for_sampler", {"model_id": tc.model_id, "seq_id": 2**70},
                               "seq_id=1180591620717411303424 is out of range"),
                              ("retrieve_future", {"request_id": {"a": 1}}, "request_id must be a string"),
                              ("asample", {"num_samples": "abc"}, "num_samples must be an integer")):
        r = httpx.post(f"{URL}/api/v1/{route}", json=body, headers=headers)
        assert r.status_code == 400 and says in r.json()["detail"], (route, r.status_code, r.text)
    saved = tc.save_state("bad-input").result().path  # load_weights naming neither target model (fuzz_tinker found a 500)
    for body, says in (({"path": saved}, "give model_id"),
                       ({"path": saved, "session_id": tc.model_id.split(":")[0]}, "give its model_seq_id")):
        r = httpx.post(f"{URL}/api/v1/load_weights", json=body, headers=headers)
        assert r.status_code == 400 and says in r.json()["detail"], (body, r.status_code, r.text)
    r = httpx.post(f"{URL}/api/v1/get_info", content=b"[" * 100_000 + b"]" * 100_000, headers=headers)
    assert r.status_code == 400 and "nests too deeply" in r.json()["detail"], r.text
    good = sft(*problems(tokenizer, 1)[0])
    short = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"].tolist()[:-1],
        "weights": good.loss_fn_inputs["weights"].tolist()[:-1]})
    with pytest.raises(Exception, match="entries for .* input tokens"):
        tc.forward_backward([short], "cross_entropy").result()
    tc2 = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(Exception, match="not supported by this service"):
        tc2.forward_backward([good], "grpo").result()
    with pytest.raises(Exception, match=r"loss .stable_reinforce. needs loss_fn_inputs \[.target_tokens., .advantages.\]; missing"):
        tc2.forward_backward([good], "stable_reinforce").result()
    with pytest.raises(Exception, match="not offered"):
        sc.create_lora_training_client(base_model="nope/nope", rank=2).result()
    assert time.time() - t0 < 60
    sc.close("success").result()


def test_a_refused_request_does_not_stall_the_clients_next_one(svc, tokenizer):
    """A request refused at submit (an unknown loss, tensors of the wrong length, bad Adam parameters, a
    bad checkpoint name) still uses up its seq_id: the same client's next forward_backward and
    optim_step are served at once, not after the 120 s gap timeout. Sampling is not ordered, so a
    refused sample request leaves the next one alone too."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    good = sft(*problems(tokenizer, 1)[0])
    short = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"].tolist()[:-1],
        "weights": good.loss_fn_inputs["weights"].tolist()[:-1]})
    refusals = [lambda: tc.forward_backward([good], "no_such_loss").result(),
                lambda: tc.forward_backward([short], "cross_entropy").result(),
                lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5)).result(),
                lambda: tc.save_weights_for_sampler(name="../escape").result()]
    for refuse in refusals:
        with pytest.raises(Exception):
            refuse()
        t0 = time.time()
        tc.forward_backward([good], "cross_entropy").result(timeout=30)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=30)
        assert time.time() - t0 < 10, "the next request waited for the refused one's seq_id"
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(good.model_input.to_ints()[:4])
    with pytest.raises(Exception):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=["a", 5])).result(timeout=30)
    t0 = time.time()
    assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result(timeout=30).sequences) == 1
    assert time.time() - t0 < 10
    sc.close("success").result()


def test_a_poisoned_sample_request_fails_alone_and_the_other_users_request_is_served(svc, tokenizer):
    """Token ids outside the vocabulary (1e12, -5, a stop id), a prompt over the context, a non-integer
    token: each refused at submit with a 4xx naming the problem, while another user's request sent in
    the same batching window is sampled."""
    import httpx

    prompt = problems(tokenizer, 1)[0][0][:4]
    good = tinker.ServiceClient(base_url=URL, api_key=svc["bob"]).create_sampling_client(base_model=BASE).result()
    headers = {"X-API-Key": svc["alice"]}

    def body(tokens, **params):
        return {"base_model": BASE, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "sampling_params": {"max_tokens": 4, **params}}

    bad = [(body([*prompt, 10**12]), "token id 1000000000000, outside the model's vocabulary"),
           (body([-5, *prompt]), "token id -5, outside"),
           (body(prompt, stop=[10**9]), "sampling_params.stop holds token id 1000000000"),
           (body(prompt * 200), "over the model's context"),
           (body([*prompt, "x"]), "must be integers"),
           ({**body(prompt), "prompt": [1, 2]}, "prompt must be an object"),
           ({**body(prompt), "num_samples": "abc"}, "num_samples must be an integer")]
    with concurrent.futures.ThreadPoolExecutor(len(bad)) as pool:
        served = good.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4))
        answers = list(pool.map(lambda b: httpx.post(f"{URL}/api/v1/asample", json=b[0], headers=headers), bad))
        assert len(served.result(timeout=60).sequences[0].tokens) >= 1
    for (_, says), r in zip(bad, answers):
        assert r.status_code == 400 and says in r.json()["detail"], (says, r.status_code, r.text)


def test_an_abandoned_sample_is_cancelled_and_the_clients_next_one_served(svc, tokenizer, ray_local):
    """cancel_future (on through the dynamic config): a request still waiting for its user's learner call
    leaves it, one in a running call has its result dropped and that call ends at its next token (nothing
    else waits for it); both promises fail as cancelled. The SDK sends it by itself when a sampling future is
    abandoned (result_async's timeout). Another user's request is a 404, as an unknown one is."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    service = ray_local.get_actor(NAME, namespace=NAMESPACE)
    learner = ray_local.get_actor(f"{NAME}-learner-{BASE}", namespace=NAMESPACE)
    prompt = problems(tokenizer, 1)[0][0][:4]
    alice = {"X-API-Key": svc["alice"]}

    def asample(max_tokens: int, n: int = 1) -> str:  # stop []: exactly max_tokens each (no early end-of-turn)
        body = {"base_model": BASE, "num_samples": n, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": max_tokens, "stop": []}}
        return httpx.post(f"{URL}/api/v1/asample", json=body, headers=alice).json()["request_id"]

    def cancel(rid, headers=alice) -> httpx.Response:
        return httpx.post(f"{URL}/api/v1/cancel_future", json={"request_id": rid}, headers=headers)

    def cancelled(state: str = "") -> int:  # cancel_future calls that found a request in ``state`` (all: "")
        found = ray_local.get(service.sample_engines.remote())["cancelled"]
        return found[state] if state else sum(found.values())

    def aborted() -> int:  # learner sampling calls ended early
        return ray_local.get(learner.usage.remote())["aborted_samples"]

    def until(what: Callable[[], bool], why: str) -> None:
        deadline = time.time() + 15
        while not what():
            assert time.time() < deadline, why
            time.sleep(0.1)

    first = aborted()

    running = asample(400, n=32)  # seconds of generation: still running when cancelled below
    time.sleep(0.5)  # on alice's learner call now: her next request waits for it
    waiting = asample(4)
    time.sleep(0.3)
    assert cancel(running, {"X-API-Key": svc["bob"]}).status_code == 404
    assert cancel(waiting).json()["state"] == "waiting"
    assert cancel(running).json()["state"] == "running"
    assert cancel(waiting).json()["state"] == "finished"  # a second cancel changes nothing
    for rid in (waiting, running):
        r = httpx.post(f"{URL}/api/v1/retrieve_future", json={"request_id": rid}, headers=alice, timeout=30)
        assert "cancelled by its client" in r.text, r.text
    assert cancel(None).status_code == 400 and cancel([1]).status_code == 400  # missing, not a string
    until(lambda: aborted() == first + 1, "the running learner call was not ended early")
    # the SDK: a sampling future abandoned by a timeout is cancelled on the service, and its learner call ends
    sampler = tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).create_sampling_client(base_model=BASE).result()
    before, running_before = cancelled(), cancelled("running")
    abandoned = sampler.sample(types.ModelInput.from_ints(prompt), 64, types.SamplingParams(max_tokens=500, stop=[]))
    # abandoned after 1 s: the SDK sends cancel_future only for a request it has submitted and polls (a future
    # abandoned while its submission is still under way sends none: at 0.2 s that happened once under the suite)
    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        asyncio.run(abandoned.result_async(timeout=1.0))
    until(lambda: cancelled() > before, "the SDK did not send cancel_future")
    if cancelled("running") > running_before:  # (it may have been cancelled before it reached the learner)
        until(lambda: aborted() == first + 2, "the abandoned learner call was not ended early")
    # alice's next request does not wait for the abandoned 64 x 500 tokens (about a minute on 2 cores)
    t0 = time.time()
    assert sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4)).result(timeout=60)
    assert time.time() - t0 < 20


def test_retrieve_future_answers_json_unless_protobuf_is_asked_for(svc, tokenizer):
    """Raw HTTP, as curl or another language sends it: a sample's result is JSON without an Accept header or
    with ``application/json``, and the same result's protobuf (what the SDK asks for) decodes to it."""
    from tinker.proto.response_conv import deserialize_sample_response

    alice = {"X-API-Key": svc["alice"]}
    prompt = problems(tokenizer, 1)[0][0][:4]
    body = {"base_model": BASE, "num_samples": 2, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": 5, "stop": [], "seed": 3}}
    rid = httpx.post(f"{URL}/api/v1/asample", json=body, headers=alice).json()["request_id"]

    def fetch(accept: Optional[str]) -> httpx.Response:
        headers = {**alice, **({"Accept": accept} if accept else {})}
        while True:
            r = httpx.post(f"{URL}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers, timeout=30)
            if "try_again" not in r.text[:200]:
                return r

    proto = fetch("application/x-protobuf")
    assert proto.headers["content-type"] == "application/x-protobuf"
    want = deserialize_sample_response(proto.content)
    for accept in (None, "application/json"):
        got = fetch(accept)
        assert got.headers["content-type"] == "application/json", accept
        seqs = got.json()["sequences"]
        assert [s["tokens"] for s in seqs] == [s.tokens for s in want.sequences] and len(seqs[0]["tokens"]) == 5
        assert all(np.allclose(g["logprobs"], w.logprobs) for g, w in zip(seqs, want.sequences))


def test_a_batch_that_fails_is_sent_again_one_request_at_a_time(svc, tokenizer, ray_local):
    """What the checks at submit miss (here: a sampler checkpoint deleted while its request waited)
    fails the shared learner call; the batcher then sends each request alone, so only that one fails."""
    from otray.tinker.service.engines import VllmSamplers
    from otray.tinker.service.futures import Futures
    from otray.tinker.service.sampling import SampleBatcher, SampleWait
    from otray.tinker.learner.prompt_scores import Scoring
    from otray.tinker.service.tinker_service import NAME, NAMESPACE
    from otray.tinker.service.stability import Recordings
    from otray.types import SamplingParams

    learner = ray_local.get_actor(f"{NAME}-learner-{BASE}", namespace=NAMESPACE)  # the running service's own
    prompt = problems(tokenizer, 1)[0][0][:4]
    params = SamplingParams(max_tokens=3, seed=1)

    async def batch() -> list:
        futures = Futures(60)
        batcher = SampleBatcher({BASE: learner}, VllmSamplers({}, {}, NAME, NAMESPACE), futures, 0.05, Recordings().add)
        waits = [SampleWait(f"r{i}", adapter, prompt, params, 1, Scoring(), None)
                 for i, adapter in enumerate([None, "/nonexistent/sampler-checkpoint", None])]
        for w in waits:
            futures.new(w.request_id, "alice")
            batcher.submit(BASE, "alice", w)
        outcomes = [await futures.wait(w.request_id, "alice", 60) for w in waits]
        return outcomes, batcher.split_batches, batcher.calls

    outcomes, splits, calls = asyncio.run(batch())
    assert calls == [3] and splits == 1  # one shared call for the three; it failed and was split
    assert [o.kind for o in outcomes] == ["proto", "error", "proto"], [o.body for o in outcomes]
    assert "nonexistent" in outcomes[1].body["error"] or "No such file" in outcomes[1].body["error"], outcomes[1]


def test_quotas_refuse_a_users_clients_past_the_limit_and_free_with_the_session(svc):
    """bob may hold 2 live training clients of LoRA rank 10 in all: past either limit a create is a 403
    naming the quota, at once (not retried like a 429); closing his session frees them; alice, on the
    service's default quota, is not limited by bob's."""
    bob = tinker.ServiceClient(base_url=URL, api_key=svc["bob"])
    bob.create_lora_training_client(base_model=BASE, rank=2).result()
    t0 = time.time()
    with pytest.raises(Exception, match="quota.lora_rank"):
        bob.create_lora_training_client(base_model=BASE, rank=9).result()
    bob.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(Exception, match="holds 2 live training clients, the limit is 2"):
        bob.create_lora_training_client(base_model=BASE, rank=1).result()
    assert time.time() - t0 < 20
    alice = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    for _ in range(3):
        alice.create_lora_training_client(base_model=BASE, rank=2).result()
    alice.close("success").result()
    bob.close("success").result()
    again = tinker.ServiceClient(base_url=URL, api_key=svc["bob"])
    again.create_lora_training_client(base_model=BASE, rank=8).result()  # the closed session's clients freed
    again.close("success").result()


def test_quotas_on_samplers_requests_waiting_and_checkpoint_storage(svc, tokenizer):
    """carol may hold 1 sampling client, 3 unfinished requests and 1 KB of checkpoints: past the first and
    the last a 403 naming the quota; past the requests a 429 (the SDK would wait and resend), and the
    requests already in finish once their missing predecessor comes."""
    carol = tinker.ServiceClient(base_url=URL, api_key=svc["carol"])
    carol.create_sampling_client(base_model=BASE).result()
    with pytest.raises(Exception, match="quota.samplers"):
        carol.create_sampling_client(base_model=BASE).result()
    tc = carol.create_lora_training_client(base_model=BASE, rank=2).result()

    def optim(seq: int) -> httpx.Response:
        return httpx.post(f"{URL}/api/v1/optim_step", headers={"X-API-Key": svc["carol"]},
                          json={"model_id": tc.model_id, "seq_id": seq, "adam_params": {"learning_rate": 1e-4}})

    waiting = [optim(seq) for seq in (2, 3, 4)]  # seq 1 not sent: they wait for it, unfinished
    assert all(r.status_code == 200 for r in waiting), [r.text for r in waiting]
    over = optim(5)
    assert over.status_code == 429 and "quota.concurrent_requests" in over.json()["detail"], over.text
    assert optim(1).status_code == 200
    for r in waiting:
        assert "metrics" in retrieve(svc["carol"], r.json()["request_id"]), r.text
    # storage: the first save fits under 1 KB used (none yet); then her files are over it
    tc = carol.create_lora_training_client(base_model=BASE, rank=2).result()
    tc.save_state("first").result()
    with pytest.raises(Exception, match="quota.storage_gb"):
        tc.save_state("second").result()
    carol.close("success").result()


def retrieve(key: str, request_id: str) -> dict:
    while True:
        out = httpx.post(f"{URL}/api/v1/retrieve_future", json={"request_id": request_id},
                         headers={"X-API-Key": key}, timeout=30).json()
        if out.get("type") != "try_again":
            return out


def lease(ray_local, key: str, model_id: str):
    """The ResourceManager's job row for a training client, as ``key``'s user sees it (None if unseen)."""
    from otray.actors.control.resource_manager import NAME, NAMESPACE

    rm = ray_local.get_actor(NAME, namespace=NAMESPACE)
    return next((j for j in ray_local.get(rm.jobs.remote(key)) if j.name == model_id), None)


def test_training_clients_are_resource_manager_leases(svc, tokenizer, ray_local):
    """Each training client is a RUNNING ``tinker`` job of its owner (``otray jobs``, the dashboard) with
    a progress row per optim_step; only its owner (or an admin) sees and cancels it; after a cancel the
    client's next request is refused before it runs and the model is unloaded; closing the session
    ends the lease SUCCEEDED."""
    from otray.actors.control.resource_manager import NAME, NAMESPACE

    rm = ray_local.get_actor(NAME, namespace=NAMESPACE)
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=1).result()
    job = lease(ray_local, svc["alice"], tc.model_id)
    assert job is not None and (job.state, job.kind, job.owner) == ("RUNNING", "tinker", "alice")
    assert lease(ray_local, svc["bob"], tc.model_id) is None
    with pytest.raises(Exception, match="cannot|not yours|no job|only"):
        ray_local.get(rm.cancel.remote(job.id, svc["bob"]))
    data = [sft(p, a) for p, a in problems(tokenizer, 2)]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    progress = lease(ray_local, svc["alice"], tc.model_id).progress
    assert progress["step"] == 2 and 0 < progress["loss"] < 20 and progress["tokens"] > 0
    assert len(ray_local.get(rm.metrics.remote(job.id, 0, svc["alice"]))) == 2
    assert ray_local.get(rm.cancel.remote(job.id, svc["alice"])).state == "CANCELLED"
    with pytest.raises(Exception, match="lease"):  # refused before it runs: no step after the cancel
        tc.forward_backward(data, "cross_entropy").result()
    with pytest.raises(Exception, match="not loaded .*lease"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert len(ray_local.get(rm.metrics.remote(job.id, 0, svc["alice"]))) == 2
    assert lease(ray_local, svc["alice"], tc.model_id).state == "CANCELLED"
    other = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    assert lease(ray_local, svc["alice"], other.model_id).state == "RUNNING"
    sc.close("success").result()
    assert lease(ray_local, svc["alice"], other.model_id).state == "SUCCEEDED"


def test_a_service_restart_keeps_every_finished_checkpoint(svc, tokenizer, ray_local):
    """The service actor is killed (Ray restarts it): checkpoints saved before are listed and load; the
    adapter that was live is reported lost with what to do, and doing it on the same ServiceClient works."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=5).result()
    tc.forward_backward([sft(*problems(tokenizer, 1)[0])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3))
    saved = tc.save_state("before-restart").result()
    ray_local.kill(ray_local.get_actor(NAME, namespace=NAMESPACE), no_restart=False)
    # the same ServiceClient goes on (its session was open when the service stopped): its first call to the
    # new service makes a model from the checkpoint, before any call that ends the predecessor's leases
    deadline = time.time() + 120
    while True:
        try:
            again = sc.create_training_client_from_state_with_optimizer(saved.path).result()
            break
        except Exception:  # noqa: BLE001 - the actor is restarting
            assert time.time() < deadline, "the service did not come back"
            time.sleep(1)
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    assert saved.path in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    lost = lease(ray_local, svc["alice"], tc.model_id)  # ended by the manager's watch, or by the new service
    assert lost.state == "FAILED" and ("lost" in lost.error or "restarted" in lost.error), lost
    assert lease(ray_local, svc["alice"], again.model_id).state == "RUNNING"  # made since: not the predecessor's
    with pytest.raises(Exception, match="not loaded .*create_training_client_from_state"):
        tc.forward_backward([sft(*problems(tokenizer, 1)[0])], "cross_entropy").result()
    again.save_state("after-restart").result()
    assert max_diff(adapter_file(svc["store"], tc.model_id, "before-restart"),
                    adapter_file(svc["store"], again.model_id, "after-restart")) == 0.0
    assert lease(ray_local, svc["alice"], again.model_id).state == "RUNNING"
    sc.close("success").result()
    assert lease(ray_local, svc["alice"], again.model_id).state == "SUCCEEDED"


def test_the_service_and_its_serve_replicas_start_without_importing_torch():
    """The TinkerService and the Serve replicas only pass adapters' specs and requests on; each of their
    processes would otherwise spend seconds of CPU importing torch (and vLLM) before its first call."""
    from tests.conftest import heavy_imports_of

    assert heavy_imports_of("otray.tinker.service.tinker_service", "otray.tinker.gateway.app",
                            "otray.tinker.gateway.oai") == []
