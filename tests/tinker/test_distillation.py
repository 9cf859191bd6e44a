"""Top-K prompt logprobs, target logprobs, alternative tokens and sampled top-K through the real SDK against
``otray tinker``, and the cookbook's top-K self-distillation (``distillation/sdft.py``) run unmodified on
them: its ``build_topk_distillation_datums`` asks a teacher (a second model name this service offers) for
its top-K over the student's completions, and the student trained on those (N, K) cross-entropy datums
moves toward the teacher. Bad values are user errors naming the field, and the next request is served."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import ROOT, SERVE_PORT, tinker_service
from tests.fixtures.promptly import answered_at_once

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
STUDENT, TEACHER = "Qwen/Qwen3-8B", "Qwen/Qwen3-32B"  # the tiny model with seeds 0 and 1
PROMPTS = [[5, 17, 42, 9, 33], [8, 101, 7, 250, 3, 60], [12, 12, 40, 77]]


@pytest.fixture(scope="module")
def svc(ray_local, tmp_path_factory, tiny_path):
    from otray.models import resolve_model_path

    teacher = resolve_model_path("tiny:1", ROOT / ".cache" / "models")
    models = [{"name": STUDENT, "path": tiny_path, "sampler": {"engine": "learner"}},
              {"name": TEACHER, "path": teacher, "sampler": {"engine": "learner"}}]
    keys, stop = tinker_service(ray_local, tmp_path_factory.mktemp("tinker_distill"), PORT, tiny_path, models=models)
    yield keys
    stop()


def test_prompt_and_sample_scores_through_the_sdk(svc):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    base = sc.create_sampling_client(base_model=STUDENT).result()
    prompt = types.ModelInput.from_ints(PROMPTS[1])
    n = len(PROMPTS[1])
    sparse = types.TensorData(data=[PROMPTS[1][1], 3, PROMPTS[1][4]], dtype="int64", shape=[n - 1, 2],
                              sparse_crow_indices=[0, 2, 2, 2, 3, 3], sparse_col_indices=[0, 1, 0])
    res = base.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=4), include_prompt_logprobs=True,
                      topk_prompt_logprobs=4, topk_sample_logprobs=2, prompt_alt_tokens_k=3,
                      target_prompt_logprobs=sparse).result(timeout=60)
    top = res.topk_prompt_logprobs
    assert top[0] is None and len(top) == n and all(len(row) == 4 for row in top[1:])
    for i in range(1, n):  # the actual token's logprob is at most the best, and equal to its top-K entry if there
        best = top[i][0][1]
        assert res.prompt_logprobs[i] <= best + 1e-6 and [lp for _, lp in top[i]] == sorted((lp for _, lp in top[i]),
                                                                                             reverse=True)
        entry = dict(top[i]).get(PROMPTS[1][i])
        assert entry is None or abs(entry - res.prompt_logprobs[i]) < 1e-5
    t = res.target_prompt_logprobs
    assert t.sparse_crow_indices == [0, 2, 2, 2, 3, 3] and t.sparse_col_indices == [0, 1, 0]
    got = np.asarray(t.data)
    assert abs(got[0] - res.prompt_logprobs[1]) < 1e-5 and abs(got[2] - res.prompt_logprobs[4]) < 1e-5
    alt = res.prompt_alt_tokens
    assert alt.tokens.shape == [n - 1, 3] and alt.logprobs.shape == [n - 1, 3]
    for seq in res.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        assert all(seq.logprobs[j] <= seq.topk_logprobs[j][0][1] + 1e-5 for j in range(len(seq.tokens)))
    last = base.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                       topk_prompt_logprobs=2, prompt_logprobs_last_n=2).result(timeout=60)
    assert last.topk_prompt_logprobs[:-2] == [None] * (n - 2) and all(last.topk_prompt_logprobs[-2:])


def test_bad_values_are_named_and_the_next_request_is_served(svc):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    base = sc.create_sampling_client(base_model=STUDENT).result()
    prompt = types.ModelInput.from_ints(PROMPTS[0])
    params = types.SamplingParams(max_tokens=1)
    cases = [({"topk_prompt_logprobs": 100_000}, "topk_prompt_logprobs=100000"),
             ({"target_prompt_logprobs": types.TensorData(data=[1, 2], dtype="int64", shape=[2, 1])}, r"\[4, K\]"),
             ({"target_prompt_logprobs": types.TensorData(data=[1, 2, 3, 9999], dtype="int64", shape=[4, 1])},
              "token id 9999")]
    for kwargs, says in cases:
        with pytest.raises(Exception, match=says):
            base.sample(prompt, 1, params, include_prompt_logprobs=True, **kwargs).result(timeout=30)
        answered_at_once(lambda: base.sample(prompt, 1, params).result(timeout=30))


def test_the_cookbooks_topk_self_distillation_moves_the_student_to_the_teacher(svc):
    from tinker_cookbook.distillation.sdft import build_topk_distillation_datums

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    student = sc.create_lora_training_client(base_model=STUDENT, rank=8, seed=0).result()
    teacher = sc.create_sampling_client(base_model=TEACHER).result()
    sampler = student.save_weights_and_get_sampling_client().result()
    data, meta = [], []
    for p, prompt in enumerate(PROMPTS):  # the student's completions, as the cookbook's RL datums hold them
        for seq in sampler.sample(types.ModelInput.from_ints(prompt), 2,
                                  types.SamplingParams(max_tokens=6, seed=p)).result(timeout=60).sequences:
            full = prompt + seq.tokens
            mask = types.TensorData.from_numpy(np.asarray([0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens),
                                                          dtype=np.float32))
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:], "mask": mask}))
            meta.append({"group_idx": p})
    teacher_prompts = [types.ModelInput.from_ints(p) for p in PROMPTS]
    datums, metrics = asyncio.run(build_topk_distillation_datums(data, meta, teacher, teacher_prompts, topk=8,
                                                                 vocab_size=512, skip_first_n_tokens=0))
    assert metrics["sdft/topk"] == 8 and metrics["sdft/mean_teacher_entropy"] > 0
    assert datums[0].loss_fn_inputs["target_tokens"].shape == [datums[0].model_input.length, 8]
    losses = []
    for _ in range(12):
        losses.append(student.forward_backward(datums, "cross_entropy").result(timeout=60).metrics["loss:sum"])
        student.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=60)
    assert losses[-1] < 0.8 * losses[0], losses  # the student's cross-entropy to the teacher's top-K falls


def test_samples_complete_through_one_session_poll(svc):
    """``sample_use_retrieve_futures``: the SDK's one poller per sampling session sees each request finish
    (otray/tinker/service/session_feeds.py); another user's session is a 404, a malformed poll a 400."""
    import httpx

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    base = sc.create_sampling_client(base_model=STUDENT).result()
    assert base.holder.get_client_config().sample_use_retrieve_futures
    futures = [base.sample(types.ModelInput.from_ints(p), 2, types.SamplingParams(max_tokens=3, seed=i))
               for i, p in enumerate(PROMPTS * 3)]
    assert all(len(f.result(timeout=60).sequences) == 2 for f in futures)
    poll = {"target": {"type": "sampling_session", "sampling_session_id": base._sampling_session_id,
                       "cloned_sampler_id": 0}, "prev_cursor": 0, "timeout": 0}
    seen = httpx.post(f"{URL}/api/v1/retrieve_futures", json=poll, headers={"X-API-Key": svc["alice"]}, timeout=30)
    assert seen.status_code == 200 and isinstance(seen.json()["cursor"], int)
    other = httpx.post(f"{URL}/api/v1/retrieve_futures", json=poll, headers={"X-API-Key": svc["bob"]}, timeout=30)
    assert other.status_code == 404
    bad = httpx.post(f"{URL}/api/v1/retrieve_futures", json={**poll, "prev_cursor": "x"},
                     headers={"X-API-Key": svc["alice"]}, timeout=30)
    assert bad.status_code == 400 and "prev_cursor" in bad.json()["detail"]
