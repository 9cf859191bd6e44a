"""Images through the Tinker API with the real SDK: ImageChunk in forward_backward datums and sampling
prompts, ImageAssetPointerChunk (data URL) in sampling, on otray's tiny Qwen2-VL; the service computes each
image's tokens and fails fast on a wrong expected_tokens; images for a text-only base, broken bytes and
remote locations are user errors naming the problem. The service's logprobs equal a local learner's."""

from __future__ import annotations

import pytest
import torch

from envs.shapes import draw, scene
from tests.conftest import SERVE_PORT, tinker_service

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
VL, TEXT = "otray/tiny-vl", "Qwen/Qwen3-8B"


@pytest.fixture(scope="module")
def svc(ray_local, tmp_path_factory, tiny_path, vl_path):
    models = [{"name": VL, "path": vl_path, "sampler": {"engine": "learner"}},
              {"name": TEXT, "path": tiny_path, "sampler": {"engine": "learner"}}]
    keys, stop = tinker_service(ray_local, tmp_path_factory.mktemp("tinker_images"), PORT, tiny_path, models=models)
    yield keys
    stop()


@pytest.fixture(scope="module")
def tok(vl_path):
    from otray.models import load_tokenizer

    return load_tokenizer(vl_path)


def prompt(tok, seed: int, expected: int | None = 4, chunk=None) -> types.ModelInput:
    """A Qwen-VL renderer's prompt: text, the picture as an image chunk between the vision tokens, text."""
    picture = draw(scene(seed)[1])
    head = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    tail = tok.encode("<|vision_end|>How many shapes?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    image = chunk or types.ImageChunk(data=picture.data, format="png", expected_tokens=expected)
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=head), image, types.EncodedTextChunk(tokens=tail)])


def datum(tok, seed: int) -> types.Datum:
    count = scene(seed)[0]
    answer = tok.encode(f"{count}<|im_end|>", add_special_tokens=False)
    mi = prompt(tok, seed).append(types.EncodedTextChunk(tokens=answer[:-1]))
    n = mi.length
    targets = [0] * (n - len(answer)) + answer
    weights = [0.0] * (n - len(answer)) + [1.0] * len(answer)
    return types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def test_image_datums_train_and_score_as_a_local_learner_does(svc, tok, vl_path):
    from otray.actors.learner.core import token_logprobs
    from otray.models import load_model
    from otray.types import Datum
    from otray.vision import Image
    from otray.vlm import vision_inputs

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=VL, rank=4, seed=1).result()
    data = [datum(tok, s) for s in range(4)]
    got = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    # the same sequences scored here: the image chunk stands for the model's 4 image tokens
    model = load_model(vl_path)
    pad = vision_inputs(model).image_token_id
    for d, out in zip(data, got):
        ids = [t for c in d.model_input.chunks for t in (c.tokens if hasattr(c, "tokens") else [pad] * 4)]
        picture = Image.from_bytes(d.model_input.chunks[1].data)
        local = Datum(ids, list(d.loss_fn_inputs["target_tokens"].tolist()), [1.0] * len(ids), [0.0] * len(ids),
                      [0.0] * len(ids), images=(picture,))
        with torch.no_grad():
            want, _ = token_logprobs(model, [local])
        assert torch.allclose(torch.tensor(out["logprobs"].tolist()), want[0], atol=1e-4)
    losses = []
    for _ in range(8):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert losses[-1] < 0.5 * losses[0]  # it learns the counts of these pictures
    # sampling from the trained weights with an image prompt: the sampler scores the prompt as the learner does
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(prompt(tok, 0), 2, types.SamplingParams(max_tokens=3, seed=1), include_prompt_logprobs=True).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) >= 1 for s in res.sequences)
    # prompt logprob i is of token i given those before it: the learner's forward with targets = the next tokens
    shown = prompt(tok, 0)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = [t for c in shown.chunks for t in (c.tokens if hasattr(c, "tokens") else [pad] * 4)]
    forward = tc.forward([types.Datum(model_input=shown, loss_fn_inputs={
        "target_tokens": ids[1:] + [0], "weights": [1.0] * len(ids)})], "cross_entropy").result()
    learner_lps = forward.loss_fn_outputs[0]["logprobs"].tolist()[:-1]
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(ids)
    assert max(abs(a - b) for a, b in zip(res.prompt_logprobs[1:], learner_lps)) < 1e-4


def test_asset_pointers_and_bad_images_are_named(svc, tok):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    base = sc.create_sampling_client(base_model=VL).result()
    picture = draw(scene(2)[1])
    pointer = types.ImageAssetPointerChunk(format="png", location=picture.data_url(), expected_tokens=4)
    via_pointer = base.sample(prompt(tok, 2, chunk=pointer), 1, types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    inline = base.sample(prompt(tok, 2), 1, types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    assert via_pointer.sequences[0].tokens == inline.sequences[0].tokens
    params = types.SamplingParams(max_tokens=2)
    cases = [(base, prompt(tok, 2, expected=5), "expected_tokens=5 but this model makes 4 tokens"),
             (base, prompt(tok, 2, chunk=types.ImageChunk(data=b"\x89PNG broken", format="png", expected_tokens=4)),
              "unreadable image"),
             (base, prompt(tok, 2, chunk=types.ImageAssetPointerChunk(format="png", location="https://example.com/a.png",
                                                                      expected_tokens=4)), "does not fetch images"),
             (base, prompt(tok, 2, chunk=types.ImageAssetPointerChunk(format="png", location="/etc/passwd",
                                                                      expected_tokens=4)), "not a data URL"),
             (sc.create_sampling_client(base_model=TEXT).result(), prompt(tok, 2), "takes no images")]
    for client, model_input, says in cases:
        with pytest.raises(Exception, match=says):
            client.sample(model_input, 1, params).result(timeout=30)
    tc = sc.create_lora_training_client(base_model=TEXT, rank=2).result()
    with pytest.raises(Exception, match="takes no images"):
        tc.forward([datum(tok, 1)], "cross_entropy").result(timeout=30)
    vl = sc.create_lora_training_client(base_model=VL, rank=2).result()
    bad = datum(tok, 1)
    bad.model_input.chunks[1] = types.ImageChunk(data=picture.data, format="png", expected_tokens=9)
    with pytest.raises(Exception, match="expected_tokens=9 but this model makes 4"):
        vl.forward([bad], "cross_entropy").result(timeout=30)
