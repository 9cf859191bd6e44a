"""The SDK 0.38 routes beyond training and sampling, through the real SDK against ``otray tinker``:
JWT auth (``/auth/token``, ``RestClient.whoami``), a user's checkpoints across runs, publishing a
checkpoint to the service's other users, checkpoint TTLs (expired ones really deleted: the test's
service allows a 1 s TTL and sweeps every 0.2 s), copies of checkpoints, the session views and search. Another user's ids get
the same 404 as unknown ones. This service runs custom losses client-side (custom_loss_server_side:
false), so the SDK's client-side path is tested here."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from tests.conftest import SERVE_PORT, tinker_fixture
from tests.fixtures.tinker_data import learner_logprobs, problems, sft

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"


svc = tinker_fixture(PORT, "tinker_rest", min_checkpoint_ttl_s=1, ttl_sweep_s=0.2, custom_loss_server_side=False)


def test_jwt_auth_and_whoami(svc, tokenizer):
    """The SDK exchanges its key for a JWT and trains with it; whoami reads the JWT's claims; a
    forged or expired JWT is a 401 marked invalid_token (the SDK gets a new one), never another user."""
    import jwt as pyjwt

    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    me = rest.whoami().result()
    assert (me.user_urn, me.org_urn) == ("tml:user:alice", "tml:organization:otray")
    assert tinker.RestClient(base_url=URL, api_key=svc["bob"]).whoami().result().user_urn == "tml:user:bob"
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    assert tc.forward_backward([sft(*problems(tokenizer, 1)[0])], "cross_entropy").result().metrics["loss:sum"] > 0

    token = httpx.post(f"{URL}/api/v1/auth/token", json={}, headers={"X-API-Key": svc["alice"]}).json()["jwt"]
    ok = httpx.get(f"{URL}/api/v1/training_runs/{tc.model_id}", headers={"X-API-Key": token})
    assert ok.status_code == 200 and ok.json()["training_run_id"] == tc.model_id
    bob = httpx.post(f"{URL}/api/v1/auth/token", json={}, headers={"X-API-Key": svc["bob"]}).json()["jwt"]
    assert httpx.get(f"{URL}/api/v1/training_runs/{tc.model_id}", headers={"X-API-Key": bob}).status_code == 404
    secret = (svc["store"] / "jwt.secret").read_bytes()
    now = int(time.time())
    forged = pyjwt.encode({"sub": "tml:user:alice", "exp": now + 600}, b"not-the-secret", algorithm="HS256")
    expired = pyjwt.encode({"sub": "tml:user:alice", "exp": now - 5}, secret, algorithm="HS256")
    for bad, says in [(forged, "not one this service minted"), (expired, "expired"), (token[:-4] + "abcd", "not one")]:
        r = httpx.get(f"{URL}/api/v1/training_runs", headers={"X-API-Key": bad})
        assert r.status_code == 401 and says in r.json()["detail"], r.text
        assert 'error="invalid_token"' in r.headers["www-authenticate"]
    r = httpx.post(f"{URL}/api/v1/auth/token", json={}, headers={"X-API-Key": "tml-nobody_wrongsecret"})
    assert r.status_code == 401
    sc.close("success").result()


def test_a_deleted_users_or_a_rotated_keys_jwt_is_refused_at_the_next_request(svc, ray_local):
    """docs/security.md promises deletion holds from the next request on: dave's JWT (and erin's, minted for
    a key since rotated) served a request, then the admin deletes dave and erin rotates her key; the very
    next request with either JWT is a 401 marked invalid_token, and exchanging the old key again is a 401.
    erin's new key gets a JWT that works."""
    from otray.actors.control.registry import tinker_key
    from otray.actors.control.resource_manager import NAME, NAMESPACE

    rm = ray_local.get_actor(NAME, namespace=NAMESPACE)
    keys = {u: tinker_key(ray_local.get(rm.add_user.remote(u, False, svc["alice"]))) for u in ("dave", "erin")}

    def jwt_of(key: str) -> str:
        return httpx.post(f"{URL}/api/v1/auth/token", json={}, headers={"X-API-Key": key}).json()["jwt"]

    def runs(credential: str) -> httpx.Response:
        return httpx.get(f"{URL}/api/v1/training_runs", headers={"X-API-Key": credential})

    tokens = {u: jwt_of(k) for u, k in keys.items()}
    assert all(runs(t).status_code == 200 for t in tokens.values())
    ray_local.get(rm.delete_user.remote("dave", svc["alice"]))
    new_erin = tinker_key(ray_local.get(rm.rotate_key.remote(None, keys["erin"])))
    for user, token in tokens.items():
        r = runs(token)
        assert r.status_code == 401 and "deleted or rotated" in r.json()["detail"], (user, r.text)
        assert 'error="invalid_token"' in r.headers["www-authenticate"]
        assert httpx.post(f"{URL}/api/v1/auth/token", json={}, headers={"X-API-Key": keys[user]}).status_code == 401
    assert runs(jwt_of(new_erin)).status_code == 200
    ray_local.get(rm.delete_user.remote("erin", svc["alice"]))


def test_user_checkpoints_publish_and_ttl(svc, tokenizer):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    bob_sc = tinker.ServiceClient(base_url=URL, api_key=svc["bob"])
    bob = tinker.RestClient(base_url=URL, api_key=svc["bob"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=1).result()
    tc.forward_backward([sft(*problems(tokenizer, 1)[0])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("a").result().path
    sampler_path = tc.save_weights_for_sampler("s").result().path
    tc.save_weights_and_get_sampling_client().result()  # an ephemeral one: not listed
    mine = rest.list_user_checkpoints().result()
    paths = [c.tinker_path for c in mine.checkpoints if c.tinker_path.startswith(f"tinker://{tc.model_id}/")]
    assert sorted(paths) == sorted([state, sampler_path]) and mine.cursor.total_count >= 2
    assert rest.list_user_checkpoints(limit=1).result().checkpoints[0].tinker_path == sampler_path  # newest first
    assert all(not c.tinker_path.startswith(f"tinker://{tc.model_id}/") for c in bob.list_user_checkpoints().result().checkpoints)

    prompt = types.ModelInput.from_ints(problems(tokenizer, 1)[0][0])
    with pytest.raises(Exception, match="no checkpoint"):
        bob_sc.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == sampler_path] == [True]
    shared = bob_sc.create_sampling_client(model_path=sampler_path).result()
    assert len(shared.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1
    for call in (lambda: bob.unpublish_checkpoint_from_tinker_path(sampler_path),
                 lambda: bob.delete_checkpoint_from_tinker_path(sampler_path),
                 lambda: bob.set_checkpoint_ttl_from_tinker_path(sampler_path, 60)):
        with pytest.raises(tinker.NotFoundError):
            call().result()  # read access is not ownership
    rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(Exception, match="no checkpoint"):
        bob_sc.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()

    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(state, 0).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    expires = [c.expires_at for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == state]
    assert expires[0] is not None
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()  # no expiry again
    assert [c.expires_at for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == state] == [None]
    files = list(svc["store"].glob("checkpoints/alice/*/weights/a"))
    assert len(files) == 1 and files[0].is_dir()
    rest.set_checkpoint_ttl_from_tinker_path(state, 1).result()
    time.sleep(2.0)
    assert not files[0].exists(), "the expired checkpoint's files are still there"
    assert state not in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_training_client_from_state(state).result()
    sc.close("success").result()


def test_session_views(svc, tokenizer):
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    session = tc.model_id.split(":")[0]
    assert session in rest.list_sessions().result().sessions
    got = rest.get_session(session).result()
    assert got.training_run_ids == [tc.model_id]
    assert len(got.sampler_ids) == 1 and got.sampler_ids[0].startswith(f"{tc.model_id}:sampler:")  # an ephemeral one
    assert rest.get_sampler(got.sampler_ids[0]).result().base_model == BASE and sampler is not None
    bob = tinker.RestClient(base_url=URL, api_key=svc["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.get_session(session).result()
    assert session not in bob.list_sessions().result().sessions
    sc.close("success").result()


def test_copy_weights_makes_an_independent_copy_that_shares_the_files(svc, tokenizer, monkeypatch):
    """RestClient.copy_weights (into a project: a label here) and ServiceClient.copy_weights: a new run of the
    caller's holds the checkpoint under its kind and name, its files hard links of the source's (no bytes
    duplicated), so deleting the source leaves the copy loadable with the same weights. Another user's
    unpublished checkpoint is a 404 and a published one copies; a TTL out of range and an access token are
    400s naming them; the SDK's retry (the same idempotency key) makes one copy."""
    monkeypatch.setenv("TINKER_PROJECT_ID", "archive")  # ServiceClient.copy_weights wants a project before it asks
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    data = [sft(p, a) for p, a in problems(tokenizer, 2)]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state, weights = tc.save_state("s").result().path, tc.save_weights_for_sampler("w").result().path
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    copy = rest.copy_weights(state, "archive", ttl_seconds=7200).result()
    assert copy != state and copy.endswith("/weights/s")
    (src,), (dst,) = (list(svc["store"].glob(f"checkpoints/alice/{p.split('/')[2].replace(':', '_')}/weights/s"))
                      for p in (state, copy))
    assert {f.name: f.stat().st_ino for f in src.iterdir()} == {f.name: f.stat().st_ino for f in dst.iterdir()}
    mine = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert mine[copy].expires_at is not None and mine[state].expires_at is None
    (usage,) = rest.get_current_checkpoint_storage_usage().result().data
    assert usage.org_user_urn == "tml:user:alice" and usage.checkpoint_count >= 3
    assert usage.size_bytes >= 2 * sum(f.stat().st_size for f in src.iterdir())  # the quota counts each copy
    sampler_copy = sc.copy_weights(weights).result()
    assert sampler_copy.endswith("/sampler_weights/w") and sampler_copy != weights
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not src.exists() and all(f.stat().st_nlink == 1 for f in dst.iterdir())
    restored = sc.create_training_client_from_state(copy).result()
    assert np.allclose(np.concatenate(learner_logprobs(restored, data)), np.concatenate(learner_logprobs(tc, data)),
                       atol=1e-5)
    bob = tinker.RestClient(base_url=URL, api_key=svc["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.copy_weights(weights, "p").result()
    rest.publish_checkpoint_from_tinker_path(weights).result()
    theirs = bob.copy_weights(weights, "p").result()
    prompt = types.ModelInput.from_ints(problems(tokenizer, 1)[0][0])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    bob_sc = tinker.ServiceClient(base_url=URL, api_key=svc["bob"])
    assert (bob_sc.create_sampling_client(model_path=theirs).sample(prompt, 1, greedy).result().sequences[0].tokens ==
            sc.create_sampling_client(model_path=weights).sample(prompt, 1, greedy).result().sequences[0].tokens)
    for call, says in [(lambda: rest.copy_weights(weights, "p", ttl_seconds=0), "out of range"),
                       (lambda: rest.copy_weights(weights, "p", weights_access_token="t"), "publish")]:
        with pytest.raises(tinker.BadRequestError, match=says):
            call().result(timeout=30)
    headers = {"X-API-Key": svc["alice"], "X-Idempotency-Key": "k-1"}
    twice = [httpx.post(f"{URL}/api/v1/copy_weights", headers=headers, json={"source_path": weights}).json()
             for _ in range(2)]
    assert twice[0] == twice[1] and twice[0]["tinker_path"].endswith("/sampler_weights/w")
    sc.close("success").result()
    bob_sc.close("success").result()


def test_search_sessions_and_project_labels(svc):
    """search_sessions finds the caller's sessions by display-name words, user_metadata, project (a label:
    set at creation or by assign_session_project) and status (active; client_finished with close()'s
    reason), newest first, in pages a cursor continues; another user's session is never found, and cannot
    be relabelled (404)."""
    S = types.SessionSearchRequest

    def opened(key: str, **kwargs) -> tinker.ServiceClient:
        sc = tinker.ServiceClient(base_url=URL, api_key=key, **kwargs)
        sc.create_sampling_client(base_model=BASE).result()  # the session starts with its first use
        return sc

    one = opened(svc["alice"], display_name="Addition sweep one", user_metadata={"exp": "x1"}, project_id="p1")
    two = opened(svc["alice"], display_name="other run")
    theirs = opened(svc["bob"], display_name="Addition sweep bob")
    rest, bob = (tinker.RestClient(base_url=URL, api_key=svc[u]) for u in ("alice", "bob"))
    (found,) = rest.search_sessions(S(display_name="sweep ADDITION")).result().sessions
    assert (found.display_name, found.project_id, found.user_metadata, found.owner, found.status.type) == (
        "Addition sweep one", "p1", {"exp": "x1"}, "tml:user:alice", "active")
    assert [s.session_id for s in rest.search_sessions(S(user_metadata={"exp": "x1"})).result().sessions] == [
        found.session_id]
    assert rest.get_session(found.session_id).result().user_metadata == {"exp": "x1"}
    two.close("interrupted").result()
    done = rest.search_sessions(S(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["interrupted"])]))
    assert [s.display_name for s in done.result().sessions] == ["other run"]
    assert not rest.search_sessions(S(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])],
                                      display_name="other")).result().sessions
    rest.assign_session_project(found.session_id, "p2").result()
    assert [s.session_id for s in rest.search_sessions(S(project_ids=["p2"])).result().sessions] == [found.session_id]
    (bobs,) = bob.search_sessions(S(display_name="bob")).result().sessions
    with pytest.raises(tinker.NotFoundError):
        bob.assign_session_project(found.session_id, "mine").result()
    for owner in (types.AccessibleSearchOwner(), types.UserSearchOwner(owner_urns=["tml:user:bob"])):
        assert bobs.session_id not in [s.session_id for s in rest.search_sessions(S(owner=owner)).result().sessions]
    seen, cursor = [], None
    while True:
        page = rest.search_sessions(S(limit=2, cursor=cursor)).result()
        seen += page.sessions
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert [s.created_at for s in seen] == sorted((s.created_at for s in seen), reverse=True)
    ids = [s.session_id for s in seen]
    assert len(ids) == len(set(ids)) >= 2 and found.session_id in ids and bobs.session_id not in ids
    assert set(ids) <= set(rest.list_sessions(limit=1000).result().sessions)
    for sc in (one, theirs):
        sc.close("success").result()


def test_what_is_not_served_is_a_quick_4xx_naming_it(svc, tokenizer):
    """The SDK 0.38 methods this service does not serve (docs/tinker_compat.md) fail at once with a 4xx
    that names the route or the option, never a 5xx (the SDK would retry it for minutes) or a hang."""
    import datetime as dt

    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    now = dt.datetime.now(dt.timezone.utc)
    calls = {
        "RestClient.get_billing_usage": lambda: rest.get_billing_usage(now - dt.timedelta(days=1), now),
        "optim_step(DimuonParams)": lambda: tc.optim_step(types.DimuonParams(learning_rate=1e-3)),
    }
    for name, call in calls.items():
        t0 = time.time()
        with pytest.raises(Exception) as err:
            call().result(timeout=30)
        status = getattr(err.value, "status_code", None)
        assert time.time() - t0 < 5, name
        assert status is None or 400 <= status < 500, (name, status, err.value)
        assert "not served" in str(err.value) or "not offered" in str(err.value), (name, err.value)
    t0 = time.time()  # the refused training requests used up their seq_ids: the next one runs at once
    tc.forward_backward([sft(*problems(tokenizer, 1)[0])], "cross_entropy").result(timeout=30)
    assert time.time() - t0 < 5
    sc.close("success").result()


def test_an_sdk_of_another_version_is_told_so_at_its_first_call(svc, monkeypatch):
    """The SDK sends its version with its first call (client/config); one the service is not tested
    with gets a 400 naming both versions and what to install, not a failure deep in a later call."""
    from tinker.lib import internal_client_holder

    monkeypatch.setattr(internal_client_holder, "tinker_sdk_version", "0.24.1")
    with pytest.raises(tinker.BadRequestError, match=r"serves the tinker SDK 0\.38\.x, and this client is tinker 0\.24\.1"):
        tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).get_server_capabilities()
    monkeypatch.setattr(internal_client_holder, "tinker_sdk_version", "0.38.7")  # any 0.38.x
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    assert [m.model_name for m in sc.get_server_capabilities().supported_models] == [BASE]


def test_custom_losses_run_client_side_with_the_gradient_of_the_same_builtin_loss(svc, tokenizer):
    """This service advertises no server-side custom losses (custom_loss_server_side: false), so the SDK
    runs them client-side (a forward, then a weighted cross-entropy backward). A custom negative
    log-likelihood (a plain function, and one traced by create_custom_loss) trains exactly as the
    built-in cross_entropy; the upload route answers a 404 saying why."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    data = [sft(p, a) for p, a in problems(tokenizer, 3)]

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    def neg_ll_list(batch, logprobs_list):
        import torch

        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in zip(batch, logprobs_list))
        return loss, {"neg_ll": float(loss.detach())}

    handle = sc.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is None  # not uploaded: this service runs custom losses client-side
    refused = httpx.post(f"{URL}/api/v1/create_custom_loss", headers={"X-API-Key": svc["alice"]},
                         json={"session_id": "s-x", "custom_loss_seq_id": 0, "graph": {"nodes": []}})
    assert refused.status_code == 404 and "client-side" in refused.json()["detail"]
    fresh = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    before = np.concatenate(learner_logprobs(fresh, data))
    after = []
    for loss in ("cross_entropy", neg_ll_list, handle):
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
        out = (tc.forward_backward(data, loss) if isinstance(loss, str) else tc.forward_backward_custom(data, loss)).result()
        if loss == "cross_entropy":
            want = out.metrics["loss:sum"]
        else:
            assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after.append(np.concatenate(learner_logprobs(tc, data)))
    assert np.abs(after[0] - before).max() > 1e-3  # the step moved the model
    assert np.allclose(after[1], after[0], atol=1e-4) and np.allclose(after[2], after[0], atol=1e-4)
    sc.close("success").result()


def test_sampler_handles_and_pickled_sampling_clients_sample_the_same_sampler(svc, tokenizer):
    """A SamplingClient passed to another process the SDK's two ways (pickle, and get_sampler_handle ->
    from_sampler_handle with the other process's key) samples the same sampler: the same greedy tokens, its
    results fetched through retrieve_futures under the number the copy got from join_sampling_session
    (1, 2, ... per sampler, never twice). A handle used with another user's key is a 404, as an unknown
    sampler is."""
    import pickle

    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=4).result()
    tc.forward_backward([sft(p, a) for p, a in problems(tokenizer, 2)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(problems(tokenizer, 1)[0][0])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    want = sampler.sample(prompt, 2, greedy).result().sequences
    handle = sampler.get_sampler_handle()
    assert svc["alice"] not in handle  # a handle carries no credentials
    copies = [pickle.loads(pickle.dumps(sampler)),
              tinker.SamplingClient.from_sampler_handle(handle, api_key=svc["alice"])]
    for copy in copies:
        got = [copy.sample(prompt, 2, greedy) for _ in range(3)]  # several in flight, polled together
        assert all([s.tokens for s in g.result(timeout=60).sequences] == [s.tokens for s in want] for g in got)
    assert sorted(c._cloned_sampler_id for c in copies) == [1, 2]  # the service numbered them
    join = [httpx.post(f"{URL}/api/v1/join_sampling_session", headers={"X-API-Key": svc[u]},
                       json={"sampling_session_id": sampler._sampling_session_id}) for u in ("alice", "bob")]
    assert join[0].json()["client_counter"] == 3 and join[1].status_code == 404
    stranger = tinker.SamplingClient.from_sampler_handle(handle, api_key=svc["bob"])
    with pytest.raises(tinker.NotFoundError):
        stranger.sample(prompt, 1, greedy).result(timeout=60)
    sc.close("success").result()


def test_a_sessions_timeline_exports_as_a_trace(svc, tokenizer):
    """export_session_trace: a signed URL (fetched with no key) to the session's requests in the Trace Event
    Format that ui.perfetto.dev opens: a track per training client and sampler, a slice per request named by
    what it asked with the part its model spent running it inside, a refused request marked as the user's
    error. Another user's session is a 404, and so is a tampered URL."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    data = [sft(p, a) for p, a in problems(tokenizer, 2)]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(Exception, match="not supported"):
        tc.forward_backward(data, "no_such_loss").result(timeout=30)
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints(problems(tokenizer, 1)[0][0]), 1, types.SamplingParams(max_tokens=3)).result()
    session = tc.model_id.split(":")[0]
    url = tinker.RestClient(base_url=URL, api_key=svc["alice"]).export_session_trace(session).result()
    got = httpx.get(url)
    assert got.status_code == 200, got.text
    events = got.json()["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    by_name = {}
    for e in slices:
        by_name.setdefault(e["name"], []).append(e)
    assert {"create_model", "forward_backward", "optim_step", "save_weights_sampler", "sample", "running"} <= set(by_name)
    assert [e["args"]["outcome"] for e in by_name["refused"]] == ["user error"]
    assert {tracks[e["tid"]] for e in by_name["forward_backward"]} == {tc.model_id.split(":", 1)[1]}
    assert any(":sampler:" in tracks[e["tid"]] for e in by_name["sample"])
    (step,) = by_name["optim_step"]
    inside = [r for r in by_name["running"] if r["tid"] == step["tid"] and step["ts"] <= r["ts"] <= step["ts"] + step["dur"]]
    assert len(inside) == 1 and inside[0]["ts"] + inside[0]["dur"] <= step["ts"] + step["dur"] + 1
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=URL, api_key=svc["bob"]).export_session_trace(session).result()
    assert httpx.get(url[:-3] + ("abc" if not url.endswith("abc") else "xyz")).status_code == 404
    sc.close("success").result()


def test_an_inflight_sampling_client_follows_later_saves_and_the_trace_names_the_version(svc, tokenizer):
    """save_weights_and_get_sampling_client(kind="inflight"), with the official SDK: the first inflight
    client samples the weights of the latest inflight save without being made again (a snapshot client made
    at the same step keeps its weights); each sample request's span in the session trace names the version
    of the target that served it. An inflight save with a name is refused by name."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    data = [sft(p, a) for p, a in problems(tokenizer, 2)]
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints())
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    fixed = tc.save_weights_and_get_sampling_client().result()
    before = first.compute_logprobs(prompt).result()
    assert before == fixed.compute_logprobs(prompt).result()
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    now = first.compute_logprobs(prompt).result()
    assert not np.allclose(now[1:], before[1:], atol=1e-3)  # the first client follows the later save ...
    assert np.allclose(now[1:], second.compute_logprobs(prompt).result()[1:], atol=1e-5)  # ... to its weights
    assert fixed.compute_logprobs(prompt).result() == before  # a snapshot stays what it was
    named = httpx.post(f"{URL}/api/v1/save_weights_for_sampler", headers={"X-API-Key": svc["alice"]},
                       json={"model_id": tc.model_id, "path": "named", "kind": "inflight"})  # this SDK sends no kind with a name
    assert named.status_code == 400 and "kind='inflight'" in named.text, named.text
    odd = httpx.post(f"{URL}/api/v1/save_weights_for_sampler", headers={"X-API-Key": svc["alice"]},
                     json={"model_id": tc.model_id, "kind": "live"})
    assert odd.status_code == 400 and "'snapshot' or 'inflight'" in odd.text, odd.text
    session = tc.model_id.split(":")[0]
    events = httpx.get(tinker.RestClient(base_url=URL, api_key=svc["alice"]).export_session_trace(session).result()).json()
    versions = [e["args"]["weights_version"] for e in events["traceEvents"]
                if e["ph"] == "X" and "weights_version" in e.get("args", {})]
    assert versions == [1, 2, 2], versions
    sc.close("success").result()
