"""otray.placement: actor options for threads and a driver's cluster environment (runs in the test process
and, for the Ray test, in two actors of the suite's local Ray)."""

import pytest

from otray.placement import cluster_env, threads_env


def test_threads_env_only_when_ray_would_give_another_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert threads_env(None, 1) == {}
    assert threads_env(2, 2.5) == {}  # Ray's default: floor(num_cpus) threads
    assert threads_env(1, 0.5) == {}  # ... and at least one
    want = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}}}
    assert threads_env(2, 1) == want
    assert threads_env(2) == want  # num_cpus unknown: always set
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # inherited by Ray's workers, so Ray's default does not apply
    assert threads_env(2, 2) == want


def test_cluster_env_sets_a_local_cluster_environment_and_sends_a_joined_one(monkeypatch):
    monkeypatch.delenv("OTRAY_TEST_A", raising=False)
    monkeypatch.setenv("OTRAY_TEST_B", "kept")
    assert cluster_env("local", {"OTRAY_TEST_A": "1", "OTRAY_TEST_B": "2"}) == {}
    import os

    assert (os.environ["OTRAY_TEST_A"], os.environ["OTRAY_TEST_B"]) == ("1", "kept")
    assert cluster_env("ray://head:10001", {"OTRAY_TEST_A": "3", "OTRAY_TEST_B": "2"}) == \
        {"runtime_env": {"env_vars": {"OTRAY_TEST_A": "1", "OTRAY_TEST_B": "kept"}}}


class Threads:
    def report(self):
        import os

        import ray
        import torch

        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), ray.get_runtime_context().runtime_env


def test_actors_get_their_threads_with_a_runtime_env_only_where_needed(ray_local, monkeypatch):
    ray = ray_local
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    plain = ray.remote(num_cpus=1)(Threads).options(**threads_env(1, 1)).remote()
    more = ray.remote(num_cpus=1)(Threads).options(**threads_env(2, 1)).remote()
    (env1, n1, rt1), (env2, n2, rt2) = ray.get([plain.report.remote(), more.report.remote()])
    assert (env1, n1) == ("1", 1) and not rt1.get("env_vars")  # no runtime_env: no setup_worker.py
    assert (env2, n2) == ("2", 2) and rt2["env_vars"]["OMP_NUM_THREADS"] == "2"
    for a in (plain, more):
        ray.kill(a)
