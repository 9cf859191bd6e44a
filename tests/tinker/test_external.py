"""External weights through the real SDK against ``otray tinker``: ``save_weights_external`` (plain and
age-encrypted), ``RestClient.get_external_weights_urls`` (signed URLs on this service that need no key),
and the cookbook's ``weights.download`` (for an export, and for a training checkpoint, which it exports,
encrypted to a key of its own, downloads, decrypts and deletes) + ``weights.build_hf_model``, whose merged
model transformers loads and scores as the training client does. Another user, a tampered or stale link,
and an export used as a model are refused by name."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from tests.conftest import SERVE_PORT, tinker_fixture
from tests.fixtures.promptly import answered_at_once
from tests.fixtures.tinker_data import problems, sft

tinker = pytest.importorskip("tinker")
pyrage = pytest.importorskip("pyrage")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"

svc = tinker_fixture(PORT, "tinker_external", user_quotas={"carol": {"storage_gb": 0.009}})  # carol: 9 MB


def trained(svc, tokenizer):
    """A LoRA client (its unembedding untouched: the tiny model ties it to the embedding, which the
    cookbook's merge cannot take a LoRA on) after three steps, and a datum to score."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0, train_unembed=False).result()
    data = [sft(*p) for p in problems(tokenizer, 4)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return sc, tc, data


def merged_logprobs(path: str, datum: types.Datum) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([datum.model_input.to_ints()])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return lp[torch.arange(ids.shape[1]), torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())].numpy()


def test_the_cookbook_downloads_an_export_and_merges_it_into_a_model(svc, tokenizer, tiny_path, tmp_path, monkeypatch):
    from tinker_cookbook import weights

    sc, tc, data = trained(svc, tokenizer)
    path = tc.save_weights_external("final").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/final"
    urls = tinker.RestClient(base_url=URL, api_key=svc["alice"]).get_external_weights_urls(path).result()
    assert sorted(urls.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert urls.expires.timestamp() > time.time() + 3000
    with urllib.request.urlopen(urls.urls["adapter_config.json"]) as r:  # no key: the link is the grant
        assert b'"r": 4' in r.read()
    monkeypatch.setenv("TINKER_API_KEY", svc["alice"])
    out = weights.download(tinker_path=path, output_dir=str(tmp_path / "adapter"), base_url=URL)
    weights.build_hf_model(base_model=tiny_path, adapter_path=out, output_path=str(tmp_path / "model"))
    want = tc.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(merged_logprobs(str(tmp_path / "model"), data[0]), want, atol=1e-4)
    # a training checkpoint: the cookbook exports it (encrypted to its own key), downloads, decrypts, deletes
    state = tc.save_state("s").result().path
    again = weights.download(tinker_path=state, output_dir=str(tmp_path / "from_state"), base_url=URL)
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("from_state", "adapter"))
    assert again == str(tmp_path / "from_state") and sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same weights, through load + export
    sc.close("success").result()


def test_encrypted_exports_links_and_refusals(svc, tokenizer):
    sc, tc, data = trained(svc, tokenizer)
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    key = pyrage.x25519.Identity.generate()
    sealed = tc.save_weights_external("sealed", ttl_seconds=3600,
                                      age_encryption_recipients=[str(key.to_public())]).result().path
    urls = rest.get_external_weights_urls(sealed).result().urls
    assert sorted(urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    with urllib.request.urlopen(urls["adapter_config.json.age"]) as r:
        body = r.read()
    assert b'"r": 4' not in body and b'"r": 4' in pyrage.decrypt(body, [key])
    # the link names one file: a changed token, another user, a deleted export are all "no such"
    token = urls["adapter_config.json.age"]
    for link in (token[:-3] + ("aaa" if not token.endswith("aaa") else "bbb"), URL + "/api/v1/external_weights/x"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(link)
        assert err.value.code == 404
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=URL, api_key=svc["bob"]).get_external_weights_urls(sealed).result()
    with pytest.raises(Exception, match="external weights export, for download"):
        sc.create_sampling_client(model_path=sealed).result().sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result(timeout=30)
    rest.delete_checkpoint_from_tinker_path(sealed).result()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(token)
    assert err.value.code == 404
    # a bad recipient is named, and the client's next request runs at once (its seq_id was used up)
    with pytest.raises(Exception, match="not an age"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result(timeout=30)
    answered_at_once(lambda: tc.forward(data[:1], "cross_entropy").result(timeout=30))
    sc.close("success").result()


def test_openai_clients_sample_base_models_and_sampler_checkpoints(svc, tokenizer):
    """``<service>/oai/api/v1``: the official openai client, a base model and a tinker:// sampler path, the
    same greedy tokens as the SDK's sampling; another user's path is a 404, a wrong key a 401."""
    import openai

    from otray.models import chat_prompt_ids

    sc, tc, _ = trained(svc, tokenizer)
    path = tc.save_weights_for_sampler("s").result().path
    client = openai.OpenAI(base_url=URL + "/oai/api/v1", api_key=svc["alice"])
    assert BASE in [m.id for m in client.models.list().data]
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    got = client.completions.create(model=BASE, prompt="12+30=", max_tokens=5, temperature=0.0)
    want = sc.create_sampling_client(base_model=BASE).result().sample(
        types.ModelInput.from_ints(tokenizer.encode("12+30=", add_special_tokens=False)), 1, greedy).result()
    assert got.choices[0].text == tokenizer.decode(want.sequences[0].tokens, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    chat = client.chat.completions.create(model=path, messages=messages, max_tokens=5, temperature=0.0, n=2)
    mine = sc.create_sampling_client(model_path=path).result().sample(
        types.ModelInput.from_ints(chat_prompt_ids(tokenizer, messages)), 1, greedy).result()
    text = tokenizer.decode(mine.sequences[0].tokens, skip_special_tokens=True)
    assert [c.message.content for c in chat.choices] == [text, text] and chat.usage.completion_tokens >= 2
    streamed = client.chat.completions.create(model=f"{BASE};{path}", messages=messages, max_tokens=5,
                                              temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=URL + "/oai/api/v1", api_key=svc["bob"]).chat.completions.create(
            model=path, messages=messages, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=URL + "/oai/api/v1", api_key="tml-nope").models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=BASE, prompt="x", max_tokens=10**9)
    sc.close("success").result()


def test_the_service_merges_a_checkpoint_into_a_model_to_download(svc, tokenizer, tmp_path):
    """``POST /api/v1/merge_weights`` (otray's own route; ``request_merge`` calls it and waits): a training
    checkpoint with the SDK's default LoRA (the tied unembedding included, which the cookbook's merge cannot
    take) becomes a full model as ``external_weights/<name>``, listed and handed out by signed URL;
    transformers loads the download and scores exactly as the training client does. Refusals name the problem, and the same
    client's next request runs at once."""
    from otray.tinker.service.merge import request_merge

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    data = [sft(*p) for p in problems(tokenizer, 4)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    state = tc.save_state("s").result().path
    merged = request_merge(URL, svc["alice"], state, "m", ttl_seconds=7200)
    assert merged == f"tinker://{tc.model_id}/external_weights/m"
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[merged].checkpoint_type == "external" and listed[merged].expires_at is not None
    assert listed[merged].user_metadata == {"merged_from": state}
    urls = rest.get_external_weights_urls(merged).result().urls
    assert {"config.json", "model.safetensors", "tokenizer.json", "otray_merged.json"} <= set(urls)
    (tmp_path / "model").mkdir()
    for name, url in urls.items():  # no key: the links are the grant
        with urllib.request.urlopen(url) as r:
            (tmp_path / "model" / name).write_bytes(r.read())
    want = tc.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(merged_logprobs(str(tmp_path / "model"), data[0]), want, atol=1e-4)
    for who, path, name, ttl, why in [("bob", state, "m2", None, "404 no checkpoint"),  # another user's
                                      ("alice", state, "m", None, "exist"), ("alice", state, "a/b", None, "name"),
                                      ("alice", state, "m3", -5, "ttl_seconds"), ("alice", merged, "m4", None, "download")]:
        with pytest.raises(RuntimeError, match=why):
            request_merge(URL, svc[who], path, name, ttl_seconds=ttl)
    with pytest.raises(Exception, match="for download"):
        sc.create_sampling_client(model_path=merged).result().sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result(timeout=30)
    answered_at_once(lambda: tc.forward(data[:1], "cross_entropy").result(timeout=30))
    rest.delete_checkpoint_from_tinker_path(merged).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(merged).result()
    sc.close("success").result()


def test_concurrent_merges_never_pass_the_storage_quota(svc, tokenizer):
    """carol's quota is 9 MB; a merge of the tiny base is ~3.4 MB. Six merge_weights sent at once: each
    reserves its base's size when it starts, so two are taken and four are refused at once naming
    quota.storage_gb (before, all six passed a check that charged the size only after the merge: 2.3x
    over); what she stores in the end is within the quota."""
    import concurrent.futures

    import httpx

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["carol"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result()
    tc.forward_backward([sft(*problems(tokenizer, 1)[0])], "cross_entropy").result()
    state = tc.save_state("s").result().path

    def merge(i: int) -> httpx.Response:
        return httpx.post(f"{URL}/api/v1/merge_weights", json={"path": state, "name": f"m{i}"},
                          headers={"X-API-Key": svc["carol"]}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(merge, range(6)))
    taken = [r.json()["request_id"] for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert len(taken) == 2, [r.text for r in answers]
    assert all(r.status_code == 403 and "quota.storage_gb" in r.json()["detail"] for r in refused), [
        (r.status_code, r.text) for r in refused]
    for rid in taken:
        while True:
            out = httpx.post(f"{URL}/api/v1/retrieve_future", json={"request_id": rid},
                             headers={"X-API-Key": svc["carol"]}, timeout=60).json()
            if out.get("type") != "try_again":
                break
        assert out.get("type") == "merge_weights", out
    stored = sum(f.stat().st_size for f in (svc["store"] / "checkpoints" / "carol").rglob("*") if f.is_file())
    assert 2 * 3e6 < stored <= 0.009e9
    sc.close("success").result()
