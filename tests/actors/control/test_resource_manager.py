"""ResourceManager on a local Ray cluster (4 CPUs): lifecycle, queue, rejects, cancel, crashes, restart."""

import time

import pytest

from otray.types import ConfigError
from tests.conftest import fresh_resource_manager, kill_resource_manager


def _job(tmp_path, tiny_path, **resources):
    return {"job": {"name": "rm-test", "output_dir": str(tmp_path / "runs")},
            "model": {"path": tiny_path},
            "rollout": {"backend": "hf", "max_model_len": 64},
            "resources": {"learner_cpus": 1, "rollout_cpus": 1, **resources},
            "algo": {"steps": 2, "batch_size": 2, "drop_uniform_groups": False},
            "eval": {"num_samples": 4},
            "checkpoint": {"save_at_end": False},
            "envs": {"arithmetic": {
                "entry": "envs.arithmetic:Arithmetic", "num_rollouts": 2, "max_tokens_per_turn": 3,
                "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": str(tmp_path / "data"),
                            "kwargs": {"num_eval": 10}},
                "splits": {"train": {}, "eval": {"shuffle": False}}}}}


def _wait(rm, ray, job_id, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = ray.get(rm.status.remote(job_id))
        if st.state in states:
            return st
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} stayed {st.state} ({st.waiting or st.error or 'no reason given'}), "
                         f"expected {states}; the cluster: {_held(ray)}")


def _held(ray) -> str:
    """What the local cluster has free, and the placement groups that hold resources now (a failure's context)."""
    held = [f"{t['name'] or pg}: {t['state']}" for pg, t in ray.util.placement_group_table().items()
            if t["state"] != "REMOVED"]
    return f"free {ray.available_resources()} of {ray.cluster_resources()}; placement groups: {held or 'none'}"


def _running_long_job(rm, ray, tmp_path, tiny_path):
    """Submit a job far too long to finish during the test (never restarted: max_failures 0); return (job id,
    placement group id) once RUNNING."""
    data = _job(tmp_path, tiny_path)
    data["algo"]["steps"] = 500
    data["job"]["max_failures"] = 0
    job_id = ray.get(rm.submit.remote(data))
    _wait(rm, ray, job_id, {"RUNNING"})
    return job_id, ray.get(rm.placement_group_id.remote(job_id))


def _pg_state(ray, pg_id):
    return ray.util.placement_group_table()[pg_id]["state"]


@pytest.fixture(scope="module")
def rm(ray_local, tmp_path_factory):
    db = tmp_path_factory.mktemp("rm") / "registry.db"
    handle = fresh_resource_manager(db)
    yield handle, db
    kill_resource_manager()


def test_jobs_run_to_success_one_at_a_time_and_free_their_leases(rm, ray_local, tmp_path, tiny_path):
    """Two jobs that fit the cluster only one at a time: the second waits QUEUED while the first runs,
    each then runs to SUCCEEDED with its placement group removed and its rows on disk."""
    handle, _ = rm
    big = _job(tmp_path, tiny_path, learner_cpus=2, rollout_cpus=1)  # 3 of 4 CPUs: one at a time
    first = ray_local.get(handle.submit.remote(big))
    second = ray_local.get(handle.submit.remote(big))
    _wait(handle, ray_local, first, {"RUNNING"})
    pg_id = ray_local.get(handle.placement_group_id.remote(first))
    assert ray_local.get(handle.status.remote(second)).state == "QUEUED"
    # why it waits, in the status: the CPUs the first job holds (once the queue has asked for its group)
    deadline, waiting = time.monotonic() + 10, ""
    while "it needs CPU 3 (free now" not in waiting and time.monotonic() < deadline:
        st = ray_local.get(handle.status.remote(second))
        waiting = st.waiting or ("" if st.state == "QUEUED" else f"left the queue: {st.state}")
        time.sleep(0.1)
    assert waiting.startswith("waiting for resources that other jobs or actors hold; it needs CPU 3 (free now"), waiting
    assert f"of 4); placement groups holding some now: otray-job-{first}" in waiting, waiting  # the first job's group
    assert ray_local.get(handle.status.remote(first)).waiting is None
    for job_id in (first, second):
        st = _wait(handle, ray_local, job_id, {"SUCCEEDED", "FAILED"})
        assert st.state == "SUCCEEDED", st.error
        assert st.progress["step"] == 2 and st.started <= st.finished
        assert (tmp_path / "runs" / job_id / "metrics.jsonl").exists()
    assert _pg_state(ray_local, pg_id) == "REMOVED"


def test_impossible_job_is_rejected_at_submit(rm, ray_local, tmp_path, tiny_path):
    handle, _ = rm
    before = len(ray_local.get(handle.jobs.remote()))
    with pytest.raises(ConfigError, match="can never fit the cluster: CPU: needs 101, the cluster has 4"):
        ray_local.get(handle.submit.remote(_job(tmp_path, tiny_path, learner_cpus=100)))
    assert len(ray_local.get(handle.jobs.remote())) == before


def test_cancel_frees_the_placement_group(rm, ray_local, tmp_path, tiny_path):
    handle, _ = rm
    job_id, pg_id = _running_long_job(handle, ray_local, tmp_path, tiny_path)
    assert _pg_state(ray_local, pg_id) == "CREATED"
    assert ray_local.get(handle.cancel.remote(job_id)).state == "CANCELLED"
    assert _pg_state(ray_local, pg_id) == "REMOVED"


def test_killed_job_actor_marks_failed_and_frees_resources(rm, ray_local, tmp_path, tiny_path):
    handle, _ = rm
    job_id, pg_id = _running_long_job(handle, ray_local, tmp_path, tiny_path)
    ray_local.kill(ray_local.get(handle.driver.remote(job_id)))
    st = _wait(handle, ray_local, job_id, {"FAILED", "SUCCEEDED"})
    assert st.state == "FAILED" and "Actor" in st.error
    assert _pg_state(ray_local, pg_id) == "REMOVED"


def test_restarted_manager_recovers_the_registry(rm, ray_local):
    from otray.actors.control.resource_manager import get_or_create

    handle, db = rm
    before = {j.id: j.state for j in ray_local.get(handle.jobs.remote())}
    assert before
    kill_resource_manager()
    again = get_or_create(str(db))
    after = {j.id: j.state for j in ray_local.get(again.jobs.remote())}
    assert after == before


def test_which_failures_a_restart_heals():
    """An actor's death (a worker, a learner, a sharded learner's rank, every rollout worker) is healed;
    bad input and failing environments are not."""
    from otray.actors.control.scheduler import healable

    assert healable("ActorDiedError: The actor died unexpectedly before finishing this task.")
    assert healable("WorkersLostError: every rollout worker failed: worker 0: ActorDiedError: ...")
    assert healable("LearnerGroupError: learner rank 1 of 2 (node n) failed: ActorDiedError: died")
    assert not healable("LearnerGroupError: learner rank 1 of 2 (node n) failed: ValueError: bad shape")
    assert not healable("ConfigError: cannot import 'nosuchmod:Env'")
    assert not healable("RolloutError: step 3: all 8 rollouts failed (env_exception)")
