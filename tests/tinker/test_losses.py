"""The SDK 0.38 losses beyond the first five, through the real SDK against ``otray tinker``:
stable_reinforce (sampling with record_stability_info, provenance on the datums), gspo with its
sequence_ratio_mask, per-token clip thresholds, and custom losses (uploaded and run server-side:
the service advertises ``custom_loss_server_side``; the client-side path is in test_rest.py). Each is checked against a float64 reference
computed here from the service's own forward logprobs; each refusal is a user error naming the
problem, and the same client's next request is served at once. The model runs with ``graph_passes`` on, so
every forward_backward and forward here is a bucketed pass (otray/tinker/learner/pass_graphs.py: eager on the
CPU; tests/tinker/test_pass_graphs.py holds them against routed passes in-process)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from otray.tinker.service.tinker_service import NAME, NAMESPACE
from tests.conftest import SERVE_PORT, tinker_fixture
from tests.fixtures.promptly import answered_at_once
from tests.fixtures.tinker_data import learner_logprobs, problems, sft

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"


svc = tinker_fixture(PORT, "tinker_losses", model={"graph_passes": True}, custom_losses={"max_losses": 3, "max_nodes": 500},
                     user_quotas={"carol": {"storage_gb": 1e-7}})  # carol: 100 bytes of storage


def rl_datum(prompt: list[int], seq, advantage: float, *, provenance: bool = True, logprobs=None) -> types.Datum:
    """The cookbook's RL datum (recipes/rl_loop.py): input = prompt + sampled[:-1], targets padded with 0 on
    the prompt, the advantage on the sampled tokens; its provenance names the sampled sequence."""
    ob = len(prompt) - 1
    n = ob + len(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]), loss_fn_inputs={
        "target_tokens": [0] * ob + seq.tokens,
        "logprobs": logprobs if logprobs is not None else [0.0] * ob + seq.logprobs,
        "advantages": [0.0] * ob + [advantage] * len(seq.tokens)})
    assert datum.model_input.length == n
    if not provenance:
        return datum
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])


def refused_then_served(tc, call, says: str, good: list[types.Datum]) -> None:
    """``call`` fails with a message containing ``says``; the client's next request is answered at once."""
    with pytest.raises(Exception, match=says):
        call().result(timeout=30)
    answered_at_once(lambda: tc.forward(good, "cross_entropy").result(timeout=30))


def test_stable_reinforce_weighs_against_the_recorded_sampler_logprobs(svc, tokenizer):
    """Sequences sampled with record_stability_info are trained on by sequence_id: the loss is
    ``-min(r, 2) * A * lp`` on the sampled tokens with ``r`` against the *recorded* logprobs (the
    client's ``logprobs`` input is ignored: garbage is sent here), zero on the prompt."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    tc.forward_backward([sft(p, a) for p, a in problems(tokenizer, 4)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # the learner now differs from step 0's sampler
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    tc.forward_backward([sft(p, a) for p, a in problems(tokenizer, 4, seed=1)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # ... and moves on: off-policy by one step
    prompt = problems(tokenizer, 1)[0][0]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, seed=2)).result()
    seqs = [s for s in res.sequences if len(s.tokens) >= 2]
    assert seqs and all(s.sequence_id for s in seqs)
    ob = len(prompt) - 1
    data = [rl_datum(prompt, s, adv, logprobs=[-50.0] * (ob + len(s.tokens))) for s, adv in zip(seqs, (1.0, -0.5, 2.0))]
    lps = learner_logprobs(tc, data)
    out = tc.forward_backward(data, "stable_reinforce").result()
    total = 0.0
    for d, s, lp, o in zip(data, seqs, lps, out.loss_fn_outputs):
        adv = np.asarray(d.loss_fn_inputs["advantages"].tolist(), np.float64)
        q = np.concatenate([np.zeros(ob), np.asarray(s.logprobs, np.float64)])
        sampled = np.concatenate([np.zeros(ob), np.ones(len(s.tokens))])
        want = sampled * -np.minimum(np.exp(lp - q), 2.0) * adv * lp
        got = np.asarray(o["elementwise_loss"].tolist())
        assert np.allclose(got, want, atol=2e-4), (got, want)
        assert np.abs(np.exp(lp - q))[ob:].max() != pytest.approx(1.0, abs=1e-3)  # really off-policy
        total += want.sum()
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-3, abs=1e-4)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["step:max"] == 3
    # kl_coeff adds the k3 estimate of KL(sampler || learner) on the sampled tokens
    lps = learner_logprobs(tc, data[:1])[0]
    kl = tc.forward(data[:1], "stable_reinforce", {"kl_coeff": 0.5, "clip_high_threshold": 1.5}).result()
    q = np.concatenate([np.zeros(ob), np.asarray(seqs[0].logprobs, np.float64)])
    r = np.exp(lps - q)
    adv = np.asarray(data[0].loss_fn_inputs["advantages"].tolist(), np.float64)
    want = np.concatenate([np.zeros(ob), np.ones(len(seqs[0].tokens))]) * (
        -np.minimum(r, 1.5) * adv * lps + 0.5 * (r - 1 - (lps - q)))
    assert np.allclose(kl.loss_fn_outputs[0]["elementwise_loss"].tolist(), want, atol=2e-4)

    good = data[:1]
    seq = seqs[0]
    plain = sc.create_sampling_client(base_model=BASE).result()  # no stability info recorded
    unrecorded = plain.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4)).result().sequences[0]
    swapped = rl_datum(prompt, seq, 1.0)
    ids = swapped.model_input.to_ints()
    ids[len(prompt)] = (ids[len(prompt)] + 1) % 100  # the first sampled token, changed
    swapped = types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=swapped.loss_fn_inputs,
                          model_input_spans=swapped.model_input_spans, loss_fn_input_spans=swapped.loss_fn_input_spans)
    on_prompt = rl_datum(prompt, seq, 1.0)
    adv = on_prompt.loss_fn_inputs["advantages"].tolist()
    adv[0] = 0.3
    on_prompt = types.Datum(model_input=on_prompt.model_input,
                            loss_fn_inputs={**on_prompt.loss_fn_inputs, "advantages": adv},
                            model_input_spans=on_prompt.model_input_spans, loss_fn_input_spans=on_prompt.loss_fn_input_spans)
    for call, says in [
        (lambda: tc.forward_backward([rl_datum(prompt, seq, 1.0, provenance=False)], "stable_reinforce"), "needs provenance"),
        (lambda: tc.forward_backward([rl_datum(prompt, unrecorded, 1.0)], "stable_reinforce"), "has no stability info"),
        (lambda: tc.forward_backward([swapped], "stable_reinforce"), rf"model_input\[{len(prompt)}\] is token"),
        (lambda: tc.forward_backward([on_prompt], "stable_reinforce"), r"advantages\[0\] is 0.3 on a position"),
        (lambda: tc.forward_backward(good, "stable_reinforce", {"beta": 0.1}), "takes no loss_fn_config"),
    ]:
        refused_then_served(tc, call, says, [sft(*problems(tokenizer, 1)[0])])
    # the recording is this session's: alice's other session and bob cannot train on it
    for key in (svc["alice"], svc["bob"]):
        other = tinker.ServiceClient(base_url=URL, api_key=key).create_lora_training_client(base_model=BASE, rank=2).result()
        refused_then_served(other, lambda: other.forward_backward(good, "stable_reinforce"), "has no stability info",
                            [sft(*problems(tokenizer, 1)[0])])
    sc.close("success").result()


def test_gspo_and_per_token_clip_thresholds(svc, tokenizer):
    """gspo: every token carries its datum's geometric-mean ratio over sequence_ratio_mask, clipped;
    ppo with per-token clip thresholds clips each token by its own (checked against float64 here)."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    rng = np.random.default_rng(0)
    base = [sft(p, a) for p, a in problems(tokenizer, 3)]
    lps = learner_logprobs(tc, base)
    data, parts = [], []
    for d, lp in zip(base, lps):
        n = d.model_input.length
        q = lp + rng.normal(0, 0.3, n)  # a sampler that disagrees with the learner
        adv = rng.normal(0, 1, n)
        mask = (np.asarray(d.loss_fn_inputs["weights"].tolist()) > 0).astype(np.float32)
        lo, hi = rng.uniform(0.5, 0.95, n), rng.uniform(1.05, 1.6, n)
        parts.append((q, adv, mask, lo, hi))
        data.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": q.astype(np.float32),
            "advantages": adv.astype(np.float32), "sequence_ratio_mask": mask}))
    out = tc.forward(data, "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    for (q, adv, mask, _, _), lp, o in zip(parts, lps, out.loss_fn_outputs):
        q = q.astype(np.float32).astype(np.float64)
        s = math.exp(((lp - q) * mask).sum() / mask.sum())
        want = -np.minimum(s * adv, np.clip(s, 0.9, 1.1) * adv)
        assert np.allclose(o["elementwise_loss"].tolist(), want, atol=2e-4)
    ppo = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": q.astype(np.float32),
        "advantages": adv.astype(np.float32), "clip_low_threshold": lo.astype(np.float32),
        "clip_high_threshold": hi.astype(np.float32)}) for d, (q, adv, _, lo, hi) in zip(base, parts)]
    out = tc.forward(ppo, "ppo").result()
    for (q, adv, _, lo, hi), lp, o in zip(parts, lps, out.loss_fn_outputs):
        r = np.exp(lp - q.astype(np.float32).astype(np.float64))
        lo, hi = lo.astype(np.float32).astype(np.float64), hi.astype(np.float32).astype(np.float64)
        want = -np.minimum(r * adv, np.clip(r, lo, hi) * adv)
        assert np.allclose(o["elementwise_loss"].tolist(), want, atol=2e-4)
    no_mask = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"}) for d in data]
    empty = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "sequence_ratio_mask": np.zeros(d.model_input.length, np.float32)}) for d in data]
    for call, says in [(lambda: tc.forward_backward(no_mask, "gspo"), "missing \\['sequence_ratio_mask'\\]"),
                       (lambda: tc.forward_backward(empty, "gspo"), "marks no token"),
                       (lambda: tc.forward_backward(ppo, "importance_sampling"), "does not read"),
                       (lambda: tc.forward_backward(data, "custom", {"loss_id": 1.0}), "forward_backward_custom")]:
        refused_then_served(tc, call, says, base[:1])
    sc.close("success").result()


def neg_ll(logprobs, weights):
    """A custom negative log-likelihood: the built-in cross_entropy, as a traced function."""
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss, "custom/tokens:mean": (weights > 0).float().sum()}


def clipped_pg(logprobs, old, advantages):
    """The built-in ppo's objective (ratio clipped to [0.8, 1.2]), written as a custom loss."""
    ratio = torch.exp(logprobs - old)
    per_token = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    return per_token.sum(), {"custom/ratio:mean": ratio.mean()}


def test_custom_losses_run_server_side_and_train_as_the_same_builtin_loss(svc, tokenizer):
    """The service advertises server-side custom losses: create_custom_loss uploads the traced graph
    (a loss id comes back) and forward_backward_custom is one forward_backward request, interpreted on
    the learner. A custom NLL trains exactly as cross_entropy, a custom clipped policy gradient as ppo
    (loss, elementwise surrogate and the step); its metrics come back reduced by their suffix."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    data = [sft(p, a) for p, a in problems(tokenizer, 3)]
    nll = sc.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    pg = sc.create_custom_loss(clipped_pg, input_ranks={"logprobs": 1, "old": 1, "advantages": 1}).result()
    assert nll.loss_id and pg.loss_id and nll.loss_id != pg.loss_id
    probe = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    lps = learner_logprobs(probe, data)
    rng = np.random.default_rng(0)
    old = [(lp + rng.normal(0, 0.2, len(lp))).astype(np.float32) for lp in lps]
    adv = [rng.normal(0, 1, len(lp)).astype(np.float32) for lp in lps]
    rl = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                                 "logprobs": q, "advantages": a})
          for d, q, a in zip(data, old, adv)]
    custom_rl = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "old": q, "advantages": a}) for d, q, a in zip(data, old, adv)]
    for builtin, batch, handle, custom_batch in (("cross_entropy", data, nll, data), ("ppo", rl, pg, custom_rl)):
        after = []
        for run in ("builtin", "custom"):
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
            out = (tc.forward_backward(batch, builtin) if run == "builtin"
                   else tc.forward_backward_custom(custom_batch, handle)).result()
            if run == "builtin":
                want = out
            else:
                assert out.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-4, abs=1e-5)
                assert "surrogate_loss:sum" not in out.metrics  # one request: nothing ran client-side
                for o, w in zip(out.loss_fn_outputs, want.loss_fn_outputs):
                    assert np.allclose(o["logprobs"].tolist(), w["logprobs"].tolist(), atol=1e-5)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            after.append(np.concatenate(learner_logprobs(tc, data)))
        assert np.abs(after[0] - np.concatenate(lps)).max() > 1e-3  # the step moved the model
        assert np.allclose(after[1], after[0], atol=1e-4), builtin
    assert out.metrics["custom/ratio:mean"] == pytest.approx(
        np.mean([np.exp(lp - q).mean() for lp, q in zip(lps, old)]), rel=1e-3)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    metrics = tc.forward_backward_custom(data, nll).result().metrics
    assert metrics["custom/tokens:mean"] == pytest.approx(np.mean([sum(w > 0 for w in d.loss_fn_inputs["weights"].tolist())
                                                                  for d in data]))
    sc.close("success").result()
    graphs = ray.get(ray.get_actor(f"{NAME}-learner-{BASE}", namespace=NAMESPACE).usage.remote())["graphs"]
    assert graphs["passes"] >= 5 and graphs["failed"] == 0, graphs  # the calls above were bucketed


def test_custom_loss_refusals_name_the_problem_and_leave_the_client_served(svc, tokenizer):
    """A graph with a disallowed operation, or past custom_losses.max_nodes, is refused at create_custom_loss
    naming it; a user past custom_losses.max_losses or her storage quota (a loss counts in it) is refused; a loss id of
    another session (another user's, or the same user's other ServiceClient) is a 404; an input at the
    wrong rank or a gather out of range (a device-side assert on a GPU) fails as the user's error, and the
    same client's next request is answered at once."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])

    def outer(logprobs):
        return torch.matmul(logprobs[:, None], logprobs[None, :]).sum(), {}

    with pytest.raises(Exception, match="torch.matmul is not on this service's list"):
        sc.create_custom_loss(outer, input_ranks={"logprobs": 1}).result(timeout=30)

    def far_gather(logprobs, index):
        return -torch.gather(logprobs, 0, index.long()).sum(), {}

    gather = sc.create_custom_loss(far_gather, input_ranks={"logprobs": 1, "index": 1}).result()
    nll = sc.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    good = [sft(*problems(tokenizer, 1)[0])]
    n = good[0].model_input.length
    far = [types.Datum(model_input=good[0].model_input, loss_fn_inputs={
        "target_tokens": good[0].loss_fn_inputs["target_tokens"], "index": np.full(n, 10 ** 6, np.float32)})]
    refused_then_served(tc, lambda: tc.forward_backward_custom(far, gather), "gather's index", good)
    scalar = [types.Datum(model_input=good[0].model_input, loss_fn_inputs={
        "target_tokens": good[0].loss_fn_inputs["target_tokens"], "weights": np.array(1.0, np.float32)})]
    refused_then_served(tc, lambda: tc.forward(scalar, "custom", {"loss_id": nll.loss_id}), "declared rank 1", good)
    def long_chain(logprobs):
        x = logprobs
        for _ in range(600):
            x = torch.abs(x)
        return x.sum(), {}

    with pytest.raises(Exception, match=r"at most 500 are served \(custom_losses.max_nodes\)"):
        sc.create_custom_loss(long_chain, input_ranks={"logprobs": 1}).result(timeout=30)
    def third(logprobs):
        return -logprobs.sum(), {}

    def fourth(logprobs):
        return -2.0 * logprobs.sum(), {}

    sc.create_custom_loss(third, input_ranks={"logprobs": 1}).result()  # her third: the limit
    with pytest.raises(Exception, match=r"3 custom losses stored, the limit is 3 \(custom_losses.max_losses\)"):
        sc.create_custom_loss(fourth, input_ranks={"logprobs": 1}).result(timeout=30)
    carol = tinker.ServiceClient(base_url=URL, api_key=svc["carol"])
    with pytest.raises(Exception, match=r"quota.storage_gb"):  # a loss's JSON counts in her storage
        carol.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result(timeout=30)
    carol.close("success").result()
    for other in (tinker.ServiceClient(base_url=URL, api_key=svc["alice"]),
                  tinker.ServiceClient(base_url=URL, api_key=svc["bob"])):
        stranger = other.create_lora_training_client(base_model=BASE, rank=2).result()
        refused_then_served(stranger, lambda: stranger.forward_backward(good, "custom", {"loss_id": nll.loss_id}),
                            "no custom loss", good)
        other.close("success").result()
    sc.close("success").result()


def test_top_k_cross_entropy_with_dense_and_sparse_2d_inputs(svc, tokenizer):
    """(N, K) target_tokens / weights (top-K distillation): dense numpy and the SDK's sparse CSR (what a
    2-D torch tensor with zeros becomes). Column k of the returned (N, K) logprobs is the 1-D forward
    of target column k; the loss is -sum_k w_k * logprob_k; a step on one (N, K) datum equals a step on
    K weighted 1-D datums."""
    import torch

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    base = [sft(p, a) for p, a in problems(tokenizer, 2)]
    K, vocab = 3, tokenizer.vocab_size

    def columns(d):
        t = np.asarray(d.loss_fn_inputs["target_tokens"].tolist())
        w = np.asarray(d.loss_fn_inputs["weights"].tolist(), np.float32)
        targets = np.stack([t, (t + 1) % vocab, (t + 5) % vocab], axis=1)
        weights = np.stack([0.6 * w, 0.3 * w, np.where(np.arange(len(t)) % 2 == 0, 0.1 * w, 0)], axis=1)
        return targets.astype(np.int64), weights.astype(np.float32)

    wide = [types.Datum(model_input=d.model_input, loss_fn_inputs=dict(zip(("target_tokens", "weights"), columns(d))))
            for d in base]
    sparse = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": torch.tensor(t * (w > 0)), "weights": torch.tensor(w)}) for d in base for t, w in [columns(d)]]
    assert sparse[0].loss_fn_inputs["weights"].sparse_crow_indices is not None  # really sent as CSR
    narrow = [[types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": t[:, k], "weights": w[:, k]}) for d in base for t, w in [columns(d)]] for k in range(K)]

    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    cols = [[np.asarray(o["logprobs"].tolist()) for o in tc.forward(narrow[k], "cross_entropy").result().loss_fn_outputs]
            for k in range(K)]
    for batch in (wide, sparse):
        out = tc.forward(batch, "cross_entropy").result()
        for i, (d, o) in enumerate(zip(batch, out.loss_fn_outputs)):
            lp = np.asarray(o["logprobs"].tolist())
            assert lp.shape == (d.model_input.length, K)
            t, w = columns(base[i])
            keep = w > 0 if batch is sparse else np.ones_like(w, bool)  # sparse: unlisted targets are token 0
            for k in range(K):
                assert np.allclose(lp[keep[:, k], k], cols[k][i][keep[:, k]], atol=1e-5)
            assert np.allclose(o["elementwise_loss"].tolist(), -(w * lp).sum(1), atol=1e-4)
    tc.forward_backward(wide, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    ref = sc.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    ref.forward_backward([d for k in range(K) for d in narrow[k]], "cross_entropy").result()
    ref.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    probe = [np.asarray(o["logprobs"].tolist()) for c in (tc, ref) for o in c.forward(base, "cross_entropy").result().loss_fn_outputs]
    assert np.allclose(np.concatenate(probe[:2]), np.concatenate(probe[2:]), atol=1e-5)
    assert np.abs(np.concatenate(probe[:2]) - np.concatenate(cols[0])).max() > 1e-4  # the step moved the model

    t, w = columns(base[0])
    bad = [(lambda: tc.forward([types.Datum(model_input=base[0].model_input, loss_fn_inputs={
                "target_tokens": t, "weights": w[:, 0]})], "cross_entropy"), "need weights of the same"),
           (lambda: tc.forward([types.Datum(model_input=base[0].model_input, loss_fn_inputs={
                "target_tokens": t, "weights": w, "logprobs": w, "advantages": w[:, 0]})], "importance_sampling"),
            "only cross_entropy's target_tokens and weights may be"),
           (lambda: tc.forward([wide[0], base[1]], "cross_entropy"), "must all be 1-D or all")]
    for call, says in bad:
        refused_then_served(tc, call, says, base[:1])
    sc.close("success").result()


def test_a_malformed_sparse_tensor_is_a_user_error_naming_it():
    """Row pointers, column indices and values that disagree with the declared (N, K) shape are refused
    at parse time (no service needed), never densified out of bounds."""
    from tinker.proto import tinker_public_pb2 as pb

    from otray.tinker.service.runs import ModelLimits
    from otray.tinker.wire.messages import parse_train_call
    from otray.tinker.errors import UserError

    def body(crow, col, values, shape=(2, 3), weights_shape=(2, 3)):
        d = pb.Datum()
        d.model_input.add().encoded_text.tokens = np.asarray([1, 2], np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dtype, t.shape[:] = pb.DTYPE_INT64, list(shape)
        t.sparse_csr.values = np.asarray(values, np.int64).tobytes()
        t.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
        t.sparse_csr.col_indices = np.asarray(col, np.int64).tobytes()
        w = d.loss_fn_inputs["weights"]
        w.dtype, w.shape[:], w.dense = pb.DTYPE_FLOAT32, list(weights_shape), np.ones(weights_shape, np.float32).tobytes()
        return pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy", data=[d]).SerializeToString()

    ok = parse_train_call(body([0, 1, 2], [0, 2], [5, 7]), lambda m: ModelLimits(100, 1000))
    assert ok.datums[0].target_k == [[5, 0, 0], [0, 0, 7]]
    for crow, col, values, shape in [([0, 1, 2], [0, 3], [5, 7], (2, 3)),  # a column past K
                                     ([0, 2, 1], [0, 1], [5, 7], (2, 3)),  # row pointers going back
                                     ([0, 1], [0], [5], (2, 3)),  # too few row pointers
                                     ([0, 1, 3], [0, 1], [5, 7], (2, 3))]:  # more entries than values
        with pytest.raises(UserError, match="malformed sparse CSR"):
            parse_train_call(body(crow, col, values, shape), lambda m: ModelLimits(100, 1000))
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        parse_train_call(body([0, 1, 2], [0, 2], [5, 700]), lambda m: ModelLimits(100, 1000))
    with pytest.raises(UserError, match=r"has shape \[1000000, 1024\]"):  # refused before anything is allocated
        parse_train_call(body([0, 1, 2], [0, 2], [5, 7], shape=(10**6, 1024)), lambda m: ModelLimits(100, 1000))


def test_recordings_are_bounded_by_tokens_and_time_and_used_ones_stay(monkeypatch):
    """Past the token budget the least recently used recordings go first (a training request's use
    counts as use); past the TTL a recording is gone; another session's or user's is not handed out."""
    from otray.tinker.service import stability
    from otray.tinker.service.stability import Recorded, Recordings
    from otray.tinker.errors import UserError

    clock = [1000.0]
    monkeypatch.setattr(stability.time, "monotonic", lambda: clock[0])
    rec = lambda: Recorded("alice", "s1", np.arange(4, dtype=np.int32), np.arange(6, dtype=np.int32),  # noqa: E731
                           np.zeros(6, np.float32))  # 10 tokens each
    r = Recordings(ttl_s=60, max_tokens=30)
    for i in range(3):
        r.add(f"q{i}", rec())
    assert set(r.take("alice", "s1", {"q0"})) == {"q0"}  # q0 used: q1 is now the least recently used
    r.add("q3", rec())
    assert sorted(r.items) == ["q0", "q2", "q3"] and r.tokens == 30
    for owner, session in (("bob", "s1"), ("alice", "s2")):
        with pytest.raises(UserError, match="no stability info in this session"):
            r.take(owner, session, {"q0"})
    clock[0] += 61
    with pytest.raises(UserError, match="'q2' has no stability info"):
        r.take("alice", "s1", {"q2"})
    assert not r.items and r.tokens == 0
