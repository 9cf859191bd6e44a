"""Leases that end with their clients: a client whose heartbeats stop, a learner that dies (healing
off; with it on, tests/tinker/test_healing.py), a service that dies. Its own ``otray tinker`` (on the
suite's Serve) with a 10 s session timeout, driven over raw HTTP (the SDK heartbeats every 10 s, so its sessions
could expire here)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import SERVE_PORT, tinker_fixture

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}/api/v1"
BASE = "Qwen/Qwen3-8B"


# 10 s: under `make test`, beside another worker's jobs, a heartbeat took > 6 s to get through (session 44)
svc = tinker_fixture(PORT, "tinker-sessions", session_timeout_s=10, healing_replay_mb=0)  # healing off: test_healing.py


def call(key: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``route``; a promise is waited for; the JSON answer."""
    r = httpx.post(f"{URL}/{route}", json=body, headers={"X-API-Key": key}, timeout=30)
    assert r.status_code < 300, r.text
    out = r.json()
    while "request_id" in out and route != "retrieve_future":
        out = call(key, "retrieve_future", {"request_id": out["request_id"]})
        if out.get("type") != "try_again":
            return out
    return out


def training_client(key: str) -> tuple[str, str]:
    """A new session and a training client in it: (session id, model id)."""
    session = call(key, "create_session", {"tags": [], "sdk_version": "test"})["session_id"]
    made = call(key, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                      "lora_config": {"rank": 2}})
    assert "model_id" in made, made
    return session, made["model_id"]


def lease_state(ray_local, key: str, model_id: str, until: str, within: float) -> tuple[str, str, float]:
    """Poll the client's lease until its state is ``until`` (or ``within`` s pass): (state, error, seconds)."""
    from otray.actors.control.resource_manager import NAME, NAMESPACE

    rm = ray_local.get_actor(NAME, namespace=NAMESPACE)
    t0 = time.time()
    while True:
        job = next(j for j in ray_local.get(rm.jobs.remote(key)) if j.name == model_id)
        if job.state == until or time.time() - t0 > within:
            return job.state, job.error or "", time.time() - t0
        time.sleep(0.2)


def test_a_client_whose_heartbeats_stop_is_ended_after_the_session_timeout(svc, ray_local):
    """alice's client sends nothing after it made its model: after session_timeout_s (10 s, + the sweep)
    its lease ends and the model is unloaded; bob's session, heartbeating, stays open."""
    bob_session = call(svc["bob"], "create_session", {"tags": [], "sdk_version": "test"})["session_id"]
    stop = threading.Event()

    def heartbeats() -> None:
        while not stop.wait(0.5):
            call(svc["bob"], "session_heartbeat", {"session_id": bob_session})

    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    bob_model = call(svc["bob"], "create_model", {"session_id": bob_session, "model_seq_id": 0, "base_model": BASE,
                                                  "lora_config": {"rank": 2}})["model_id"]
    session, model = training_client(svc["alice"])
    assert lease_state(ray_local, svc["alice"], model, "RUNNING", 0)[0] == "RUNNING"
    state, _, took = lease_state(ray_local, svc["alice"], model, "SUCCEEDED", 25)
    assert state == "SUCCEEDED" and took > 5, (state, took)
    r = httpx.post(f"{URL}/optim_step", json={"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
                   headers={"X-API-Key": svc["alice"]})
    assert r.status_code == 404 and "expired" in r.json()["detail"], r.text
    r = httpx.post(f"{URL}/session_heartbeat", json={"session_id": session}, headers={"X-API-Key": svc["alice"]})
    assert r.status_code == 404
    assert lease_state(ray_local, svc["bob"], bob_model, "RUNNING", 0)[0] == "RUNNING"
    stop.set()
    beating.join()


def test_a_learner_that_dies_fails_its_models_leases_at_once_and_a_new_one_serves(svc, ray_local):
    """With healing off (``healing_replay_mb: 0``) a dead learner's models end FAILED at once, with why."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    _, model = training_client(svc["alice"])
    learner = ray_local.get_actor(f"{NAME}-learner-{BASE}", namespace=NAMESPACE)
    ray_local.kill(learner, no_restart=False)
    state, error, took = lease_state(ray_local, svc["alice"], model, "FAILED", 20)
    assert state == "FAILED" and "learner" in error and "died" in error and took < 10, (state, error, took)
    deadline = time.time() + 60
    while True:  # the learner Ray starts again: until it is up, a create fails saying it is restarting
        try:
            _, again = training_client(svc["alice"])
            break
        except AssertionError as e:
            assert "restarting" in str(e) and time.time() < deadline, e
            time.sleep(1)
    out = call(svc["alice"], "optim_step", {"model_id": again, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}})
    assert out.get("type") == "optim_step", out


def test_a_service_that_dies_fails_its_leases_at_once(svc, ray_local):
    """The service actor is killed for good (no restart): the ResourceManager ends its clients' leases
    FAILED at once, with the reason; nothing waits for a restart."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    _, model = training_client(svc["bob"])
    ray_local.kill(ray_local.get_actor(NAME, namespace=NAMESPACE), no_restart=True)
    state, error, took = lease_state(ray_local, svc["bob"], model, "FAILED", 20)
    assert state == "FAILED" and "lost" in error and took < 10, (state, error, took)
