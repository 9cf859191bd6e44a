"""The SDK 0.38 routes beyond training and sampling, through the real SDK against ``otray tinker``:
JWT auth (``/auth/token``, ``RestClient.whoami``), a user's checkpoints across runs, publishing a
checkpoint to the service's other users, checkpoint TTLs (expired ones really deleted: the test's
service allows a 1 s TTL and sweeps every 0.2 s), and the session views. Another user's ids get
the same 404 as unknown ones."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import tinker_fixture
from tests.fixtures.tinker_data import problems, sft

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = 8028
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"


svc = tinker_fixture(PORT, "tinker_rest", min_checkpoint_ttl_s=1, ttl_sweep_s=0.2)


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
    files = list(svc["store"].glob(f"checkpoints/alice/*/weights/a"))
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


def test_what_is_not_served_is_a_quick_4xx_naming_it(svc, tokenizer, monkeypatch):
    """The SDK 0.38 methods this service does not serve (docs/tinker_compat.md) fail at once with a 4xx
    that names the route or the option, never a 5xx (the SDK would retry it for minutes) or a hang."""
    import datetime as dt

    monkeypatch.setenv("TINKER_PROJECT_ID", "p")  # ServiceClient.copy_weights wants a project before it asks
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    path = tc.save_state("x").result().path
    session = tc.model_id.split(":")[0]
    now = dt.datetime.now(dt.timezone.utc)
    calls = {
        "RestClient.copy_weights": lambda: rest.copy_weights(path, "p"),
        "ServiceClient.copy_weights": lambda: sc.copy_weights(path),
        "RestClient.export_session_trace": lambda: rest.export_session_trace(session),
        "RestClient.assign_session_project": lambda: rest.assign_session_project(session, "p"),
        "RestClient.search_sessions": lambda: rest.search_sessions(types.SessionSearchRequest()),
        "RestClient.get_billing_usage": lambda: rest.get_billing_usage(now - dt.timedelta(days=1), now),
        "RestClient.get_current_checkpoint_storage_usage": lambda: rest.get_current_checkpoint_storage_usage(),
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
