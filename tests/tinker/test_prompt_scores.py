"""Top-K prompt and sample logprobs, target logprobs and alternative tokens (otray/tinker/learner/prompt_scores.py)
on the AdapterLearner in-process (tiny model), each against a reference computed here from the model's
own logits with plain transformers; and the request checks that refuse bad values by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from otray.tinker.learner.adapter_learner import AdapterLearner
from otray.tinker.learner.sample_jobs import SampleJob
from otray.tinker.learner.prompt_scores import SENTINEL_LOGPROB, Scoring, cut_before, parse_scoring, parse_targets
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import ASample
from otray.types import SamplingParams


@pytest.fixture(scope="module")
def learner(tiny_path):
    return AdapterLearner(tiny_path)


def reference(learner, tokens: list[int]) -> np.ndarray:
    """log-softmax over the vocabulary at positions 1..len-1 of ``tokens`` (row i: the distribution of
    token i + 1), from the base model's logits."""
    with torch.no_grad():
        logits = learner.base(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].numpy()


PROMPT = [5, 17, 42, 9, 33, 8, 101, 7]


def test_topk_targets_alt_and_sample_topk_match_the_models_own_distributions(learner):
    k = 6
    targets = parse_targets({"dtype": "int64", "shape": [len(PROMPT) - 1, 2],
                             "data": [t for i in range(len(PROMPT) - 1) for t in (PROMPT[i + 1], -1 if i % 2 else 3)]},
                            len(PROMPT), 512, 256)
    job = SampleJob(None, [PROMPT], SamplingParams(max_tokens=4, seed=3, temperature=1.0, ignore_eos=True), 2,
                    Scoring(True, topk=k, sample_topk=3, alt_k=5), targets=[targets])
    out = learner.sample([job])[0][0]
    ref = reference(learner, PROMPT)
    s = out.scores
    # prompt logprobs: row i + 1 is the logprob of PROMPT[i + 1]
    assert out.prompt_logprobs[0] is None
    assert np.allclose(out.prompt_logprobs[1:], ref[np.arange(len(ref)), PROMPT[1:]], atol=1e-5)
    # top-K: the sentinel at position 0, then the K largest, in order
    ids, vals = s.topk
    assert ids.shape == (len(PROMPT), k) and (ids[0] == 0).all() and (vals[0] == SENTINEL_LOGPROB).all()
    for i in range(len(ref)):
        want = np.argsort(-ref[i])[:k]
        assert np.allclose(vals[i + 1], ref[i][want], atol=1e-5) and set(ids[i + 1]) == set(want)
    # targets: the asked ids' logprobs, 0.0 where -1 asked nothing
    want = np.stack([ref[np.arange(len(ref)), PROMPT[1:]],
                     np.where(np.arange(len(ref)) % 2, 0.0, ref[:, 3])], axis=1)
    assert s.targets.shape == (len(PROMPT) - 1, 2) and np.allclose(s.targets, want, atol=1e-5)
    # alternative tokens: 5 draws a position, their logprobs the model's; the seed repeats them
    alt_ids, alt_lps = s.alt
    assert alt_ids.shape == (len(PROMPT) - 1, 5)
    assert np.allclose(alt_lps, np.take_along_axis(ref, alt_ids, 1), atol=1e-5)
    again = learner.sample([job])[0][0].scores
    assert (again.alt[0] == alt_ids).all()
    # the draws are at the request's temperature: cold, the most likely token is drawn most often
    # (the untrained tiny model is near uniform at temperature 1)
    many = learner.sample([SampleJob(None, [PROMPT], SamplingParams(max_tokens=1, seed=1, temperature=0.05), 1,
                                     Scoring(alt_k=256))])[0][0].scores.alt[0]
    assert all(np.bincount(many[i], minlength=512).argmax() == ref[i].argmax() for i in range(len(ref)))
    # temperature 0: every draw is the most likely token
    greedy = learner.sample([SampleJob(None, [PROMPT], SamplingParams(max_tokens=1, temperature=0.0), 1,
                                       Scoring(alt_k=3))])[0][0].scores.alt[0]
    assert (greedy == ref.argmax(-1)[:, None]).all()
    # sampled top-K: per sample, per sampled token, the K largest of that step's distribution
    assert len(s.sample_topk) == 2
    for sample, (sids, svals) in zip(out.samples, s.sample_topk):
        full = reference(learner, PROMPT + sample.token_ids)[len(PROMPT) - 1:]
        assert sids.shape == (len(sample.token_ids), 3)
        assert np.allclose(svals, -np.sort(-full, axis=1)[:, :3], atol=1e-5)
        assert np.allclose(sample.logprobs, full[np.arange(len(full)), sample.token_ids], atol=1e-4)


def test_last_n_blanks_the_topk_rows_before_it(learner):
    job = SampleJob(None, [PROMPT], SamplingParams(max_tokens=1), 1, Scoring(True, topk=2))
    scores = cut_before(learner.sample([job])[0][0].scores, 3)
    assert (scores.topk[1][:-3] == SENTINEL_LOGPROB).all() and (scores.topk[1][-3:] > SENTINEL_LOGPROB).all()


def test_sparse_targets_and_bad_requests_are_refused_by_name():
    t = parse_targets({"dtype": "int64", "shape": [3, 4], "data": [7, 9, 11], "sparse_crow_indices": [0, 1, 1, 3],
                       "sparse_col_indices": [2, 0, 3]}, 4, 512, 256)
    assert t.ids.tolist() == [[-1, -1, 7, -1], [-1, -1, -1, -1], [9, -1, -1, 11]] and t.crow == [0, 1, 1, 3]
    bad = [
        ({"dtype": "float32", "shape": [3, 1], "data": [1, 2, 3]}, "int64"),
        ({"dtype": "int64", "shape": [2, 1], "data": [1, 2]}, r"\[3, K\]"),
        ({"dtype": "int64", "shape": [3, 1], "data": [1, 2]}, "2 values"),
        ({"dtype": "int64", "shape": [3, 1], "data": [1, 2, 512]}, "token id 512"),
        ({"dtype": "int64", "shape": [3, 2], "data": [1], "sparse_crow_indices": [0, 1, 1],
          "sparse_col_indices": [0]}, "malformed sparse CSR"),
        ({"dtype": "int64", "shape": [3, 2], "data": [1], "sparse_crow_indices": [0, 1, 1, 1],
          "sparse_col_indices": [5]}, "malformed sparse CSR"),
    ]
    for raw, says in bad:
        with pytest.raises(UserError, match=says):
            parse_targets(raw, 4, 512, 256)
    for req, says in (({"topk_prompt_logprobs": 257}, "topk_prompt_logprobs=257"),
                      ({"topk_sample_logprobs": -1}, "topk_sample_logprobs=-1"),
                      ({"prompt_alt_tokens_k": "3"}, "prompt_alt_tokens_k='3'")):
        with pytest.raises(UserError, match=says):
            parse_scoring(asample(req), 4, 512, 256)
    assert parse_scoring(asample({"topk_prompt_logprobs": 5, "prompt_logprobs": True}), 4, 512, 256)[0] == Scoring(True, 5)


def asample(fields: dict) -> ASample:
    """An asample body with ``fields`` (and an empty prompt and sampling parameters), as the gateway parses it."""
    return ASample.of({"prompt": {"chunks": []}, "sampling_params": {}, **fields})
