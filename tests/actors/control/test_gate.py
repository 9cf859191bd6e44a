"""The security boundary on a real local Ray: ResourceManager methods refuse callers without the
right key, job token or checkpoint grant; auth survives a restart and cannot be downgraded; keys
are revoked at once; failures are honest (innermost error stored, a step whose rollouts all failed
or whose only worker died fails the job without a checkpoint of it)."""

import time
from pathlib import Path

import pytest

from otray.actors.control.registry import AuthError
from otray.trust import ForbiddenConfigError
from tests.conftest import fresh_resource_manager, kill_resource_manager
from tests.fixtures.jobs import admin_cfg, user_cfg, wait_job



@pytest.fixture(scope="module")
def keyed(ray_local, tmp_path_factory):
    """A ResourceManager with auth on: root (admin), alice and bob; alice's finished job with a checkpoint."""
    db = tmp_path_factory.mktemp("sec") / "registry.db"
    rm = fresh_resource_manager(db, auth_enabled=True)
    root = ray_local.get(rm.add_user.remote("root"))
    alice, bob = (ray_local.get(rm.add_user.remote(n, False, root)) for n in ("alice", "bob"))
    data = user_cfg(None, None)
    data["checkpoint"] = {"save_at_end": True}
    job = ray_local.get(rm.submit.remote(data, alice))
    assert wait_job(ray_local, rm, job, alice).state == "SUCCEEDED"
    yield {"rm": rm, "db": db, "root": root, "alice": alice, "bob": bob, "job": job}
    kill_resource_manager()


def test_rm_methods_refuse_callers_without_the_right_key_token_or_grant(keyed, ray_local):
    rm, job, alice, bob, root = keyed["rm"], keyed["job"], keyed["alice"], keyed["bob"], keyed["root"]
    metrics = ray_local.get(rm.metrics.remote(job, 0, alice))
    steps = ray_local.get(rm.checkpoints.remote(job, alice))
    assert steps == [2]
    # a job's driver calls: without its token, or with a guessed one
    for call in (rm.report.remote(job, {"step": 99}), rm.report.remote(job, {"step": 99}, "guess"),
                 rm.report_episodes.remote(job, [{"step": 99}]), rm.report_outputs.remote(job, [{"x": 1}]),
                 rm.put_checkpoint.remote(job, 99, b""), rm.ref_blob.remote(job, f"{job}:2")):
        with pytest.raises(AuthError, match="not the job token"):
            ray_local.get(call)
    assert ray_local.get(rm.metrics.remote(job, 0, alice)) == metrics  # nothing rewritten or injected
    assert ray_local.get(rm.checkpoints.remote(job, alice)) == steps
    # the Serve app's checkpoint download needs a grant, which only the owner's key obtains
    with pytest.raises(AuthError, match="no grant"):
        ray_local.get(rm.serve_checkpoint_blob.remote(job, 2))
    with pytest.raises(KeyError, match="no job .* of yours"):
        ray_local.get(rm.serve_grant.remote(job, 2, bob))
    for odd in (["x"], 7, None):  # any value may come over Ray: an unknown job, never a database error
        with pytest.raises(KeyError, match="no job .* of yours"):
            ray_local.get(rm.status.remote(odd, alice))
        with pytest.raises(AuthError, match="not the job token"):
            ray_local.get(rm.report.remote(odd, {"step": 1}, "t"))
    step, grant, _ = ray_local.get(rm.serve_grant.remote(job, None, alice))
    assert step == 2 and len(ray_local.get(rm.serve_checkpoint_blob.remote(job, 2, grant))) > 1000
    with pytest.raises(AuthError, match="no grant"):
        ray_local.get(rm.serve_checkpoint_blob.remote(job, 1, grant))  # a grant is for one checkpoint
    # users' methods on another user's job, and admin-only methods
    # users' methods on another user's job: answered exactly like a job id that does not exist (no oracle)
    fake = job[:-6] + ("000000" if not job.endswith("000000") else "111111")
    for method, args in ((rm.checkpoint_blob, (None,)), (rm.cancel, ()), (rm.metrics, (0,)), (rm.status, ())):
        answers = []
        for job_id in (job, fake):
            with pytest.raises(KeyError) as refused:
                ray_local.get(method.remote(job_id, *args, bob))
            answers.append(str(refused.value.cause if hasattr(refused.value, "cause") else refused.value))
        assert answers[0].replace(job, "ID") == answers[1].replace(fake, "ID"), answers
    for call in (rm.driver.remote(job, bob), rm.placement_group_id.remote(job, bob), rm.users.remote(bob),
                 rm.delete_user.remote("alice", bob), rm.allow_modules.remote(["mine"], bob),
                 rm.rotate_key.remote("alice", bob), rm.allow_urls.remote(["http://10.0.0.5:8090"], bob)):
        with pytest.raises(AuthError, match="only an admin"):
            ray_local.get(call)
    assert [u.name for u in ray_local.get(rm.users.remote(root))] == ["root", "alice", "bob"]
    assert ray_local.get(rm.allow_urls.remote(["http://10.0.0.5:8090/"], root)) == ["http://10.0.0.5:8090"]
    assert ray_local.get(rm.allowed_urls.remote()) == ["http://10.0.0.5:8090"]
    with pytest.raises(ValueError, match="not http"):
        ray_local.get(rm.allow_urls.remote(["file:///etc/passwd"], root))


def test_users_jobs_are_confined(keyed, ray_local):
    rm, job, bob = keyed["rm"], keyed["job"], keyed["bob"]
    area = Path(keyed["db"]).parent / "users" / "alice"
    assert (area / "runs" / job / "metrics.jsonl").exists() and (area / "data" / "data" / "arithmetic").is_dir()
    before = len(ray_local.get(rm.jobs.remote(keyed["root"])))
    attack = user_cfg(None, None)
    attack["envs"]["arithmetic"]["dataset"] = {"builder": "builtins:exec", "dir": "open('/tmp/pwned', 'w')"}
    with pytest.raises(ForbiddenConfigError, match="envs.arithmetic.dataset.builder: 'builtins:exec'"):
        ray_local.get(rm.submit.remote(attack, bob))
    stolen = user_cfg(None, None)
    stolen["checkpoint"] = {"resume_from": str(area / "runs" / job / "checkpoints" / "step-000002")}
    with pytest.raises(ForbiddenConfigError, match="checkpoint.resume_from: .* is a directory"):
        ray_local.get(rm.submit.remote(stolen, bob))
    anywhere = user_cfg(None, None)
    anywhere["job"]["output_dir"] = "/work"
    with pytest.raises(ForbiddenConfigError, match="job.output_dir"):
        ray_local.get(rm.submit.remote(anywhere, bob))
    assert len(ray_local.get(rm.jobs.remote(keyed["root"]))) == before  # nothing queued
    assert not Path("/tmp/pwned").exists()


def test_keys_are_revoked_and_rotated_at_once(keyed, ray_local):
    rm, root = keyed["rm"], keyed["root"]
    carol = ray_local.get(rm.add_user.remote("carol", False, root))
    assert ray_local.get(rm.whoami.remote(carol)).name == "carol"
    new = ray_local.get(rm.rotate_key.remote(None, carol))  # a user rotates their own key
    with pytest.raises(AuthError, match="wrong API key"):
        ray_local.get(rm.whoami.remote(carol))
    assert ray_local.get(rm.whoami.remote(new)).name == "carol"
    ray_local.get(rm.delete_user.remote("carol", root))
    with pytest.raises(AuthError, match="wrong API key"):
        ray_local.get(rm.whoami.remote(new))


def test_job_error_is_the_innermost_exception_and_the_cli_calls_it_bad_input(keyed, ray_local, tmp_path):
    from dataclasses import replace

    from otray.cli import report_failure

    rm, root = keyed["rm"], keyed["root"]
    data = admin_cfg(tmp_path)
    data["envs"]["arithmetic"]["entry"] = "nosuchmod:Env"  # an admin's config: imported on the cluster
    job = ray_local.get(rm.submit.remote(data, root))
    st = wait_job(ray_local, rm, job, root)
    assert st.state == "FAILED" and st.error.startswith("ConfigError: cannot import 'nosuchmod:Env'"), st.error
    assert "ray::" not in st.error
    assert report_failure(job, st) == 2
    assert report_failure(job, replace(st, error="RolloutError: step 3: all 8 rollouts failed")) == 1


def test_a_step_whose_rollouts_all_failed_fails_the_job_without_its_checkpoint(keyed, ray_local, tmp_path):
    rm, root = keyed["rm"], keyed["root"]
    data = admin_cfg(tmp_path)
    data["envs"]["arithmetic"]["entry"] = "tests.fixtures.failing_envs:FailsAfterReset"
    data["checkpoint"] = {"save_every": 1}
    job = ray_local.get(rm.submit.remote(data, root))
    st = wait_job(ray_local, rm, job, root)
    assert st.state == "FAILED", st
    assert st.error.startswith("RolloutError: step 1: all 4 rollouts failed (env_exception)"), st.error
    assert ray_local.get(rm.checkpoints.remote(job, root)) == []


def _kill_process_of(ray, class_name, wait_s=30.0):
    """SIGKILL the process of the one live actor of ``class_name`` (a crash, not a polite ray.kill), once it
    is the only one (an earlier job's or attempt's actors may take a moment to go)."""
    import os
    import signal

    deadline = time.time() + wait_s
    while True:
        table = ray._private.state.actors().values()  # the state API needs the dashboard, which is off
        pids = [a["Pid"] for a in table if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]
        if len(pids) == 1 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert len(pids) == 1, (class_name, pids)
    os.kill(pids[0], signal.SIGKILL)
    return time.time()


def _running_job(ray, rm, root, tmp_path, max_failures=0):
    data = admin_cfg(tmp_path, steps=500)
    data["checkpoint"] = {"save_every": 1}
    data["job"]["max_failures"] = max_failures  # 0: a death ends the job (healing is tested below)
    job = ray.get(rm.submit.remote(data, root))
    wait_job(ray, rm, job, root, until="step")
    return job, ray.get(rm.placement_group_id.remote(job, root))


@pytest.mark.parametrize("victim", ["RolloutWorker", "PolicyLearner"])
def test_a_killed_worker_or_learner_fails_the_job_and_frees_its_lease(keyed, ray_local, victim, tmp_path):
    """With job.max_failures 0 a death ends the job FAILED, naming the dead actor (the worker's death surfaces
    where the driver met it first: its fleet's WorkersLostError, or the actor's own ActorDiedError)."""
    rm, root = keyed["rm"], keyed["root"]
    job, pg = _running_job(ray_local, rm, root, tmp_path)
    killed_at = _kill_process_of(ray_local, victim)
    st = wait_job(ray_local, rm, job, root, timeout=60)
    named = {"RolloutWorker": ("rollout worker", "class_name: RolloutWorker"), "PolicyLearner": ("Actor",)}[victim]
    assert st.state == "FAILED" and any(n in st.error for n in named), st
    assert time.time() - killed_at < 60
    assert ray_local.util.placement_group_table()[pg]["state"] == "REMOVED"
    trained = max(r["step"] for r in ray_local.get(rm.metrics.remote(job, 0, root)) if r.get("phase") == "grpo")
    assert max(ray_local.get(rm.checkpoints.remote(job, root))) <= trained  # none saved from a failed step


def _wait(ray, rm, job, root, done, what, timeout=120):
    deadline = time.time() + timeout
    while True:
        st = ray.get(rm.status.remote(job, root))
        if done(st):
            return st
        assert time.time() < deadline and not st.terminal, f"{what}: {st}"
        time.sleep(0.3)


def test_a_killed_worker_learner_and_driver_are_healed_from_the_last_checkpoint(keyed, ray_local, tmp_path):
    """job.max_failures 3: a rollout worker, the learner and the job driver killed in turn (their processes
    SIGKILLed mid-run). The worker is replaced in its bundle and the job goes on (no restart); for the learner
    and the driver the job restarts in its placement group from its last checkpoint. Each shows as a line of
    its status (a restart also as a recovery row), and the job SUCCEEDS with every step's row exactly once.
    A second job with max_failures 1 killed twice ends FAILED naming both failures. No placement group is
    left behind."""
    rm, root = keyed["rm"], keyed["root"]
    data = admin_cfg(tmp_path, steps=14)
    data["checkpoint"] = {"save_every": 1}
    data["job"]["max_failures"] = 3
    job = ray_local.get(rm.submit.remote(data, root))
    wait_job(ray_local, rm, job, root, until="step")
    pg = ray_local.get(rm.placement_group_id.remote(job, root))
    _kill_process_of(ray_local, "RolloutWorker")
    st = _wait(ray_local, rm, job, root, lambda st: len(st.recoveries) == 1, "the killed worker was not replaced")
    assert st.state.value == "RUNNING" and "rollout worker 0 replaced in its bundle" in st.recoveries[0], st
    rows = ray_local.get(rm.metrics.remote(job, 0, root))
    assert not [r for r in rows if "recovery/failure" in r]  # no restart
    assert [r for r in rows if r["phase"] == "recovery"][0]["recovery/workers"] == st.recoveries[0].split(": ", 1)[1]
    for k, victim in enumerate(("PolicyLearner", "JobDriver"), 1):
        _kill_process_of(ray_local, victim)
        st = _wait(ray_local, rm, job, root, lambda st: len(st.recoveries) == k + 1, f"no recovery from the {victim}'s death")
        assert st.state.value == "RUNNING" and ray_local.get(rm.placement_group_id.remote(job, root)) == pg
        resumed = ray_local.get(rm.metrics.remote(job, 0, root))[-1]
        assert resumed["phase"] == "recovery" and resumed["recovery/failure"] == k, resumed
        _wait(ray_local, rm, job, root, lambda st: st.progress.get("phase") == "grpo"
              and st.progress["step"] > resumed["step"], f"the job did not go on after the {victim}'s death")
    st = wait_job(ray_local, rm, job, root, timeout=240)
    assert st.state.value == "SUCCEEDED" and len(st.recoveries) == 3, st
    assert "rollout worker 0 replaced" in st.recoveries[0] and "ActorDiedError" in st.recoveries[1]
    steps = [r["step"] for r in ray_local.get(rm.metrics.remote(job, 0, root)) if r["phase"] == "grpo"]
    assert steps == list(range(1, 15)), steps  # no gap, no duplicate
    second, _ = _running_job(ray_local, rm, root, tmp_path, max_failures=1)
    _kill_process_of(ray_local, "PolicyLearner")
    _wait(ray_local, rm, second, root, lambda st: len(st.recoveries) == 1, "no recovery")
    wait_job(ray_local, rm, second, root, until="step")
    _wait(ray_local, rm, second, root, lambda st: st.progress.get("phase") == "grpo", "no step after the restart")
    _kill_process_of(ray_local, "PolicyLearner")
    st = wait_job(ray_local, rm, second, root, timeout=60)
    assert st.state.value == "FAILED" and "; earlier failure 1 (healed by a restart): ActorDiedError" in st.error, st
    deadline = time.time() + 30
    while any(t["name"].startswith("otray-job-") and t["state"] != "REMOVED"
              for t in ray_local.util.placement_group_table().values()):
        assert time.time() < deadline, "a placement group was left behind"
        time.sleep(0.5)


def test_a_crashed_manager_restarts_fails_its_running_job_and_keeps_auth(keyed, ray_local, tmp_path):
    from otray.actors.control.resource_manager import get_or_create
    from otray.cli import report_failure
    from otray.client import Client, ManagerGoneError

    rm, db, alice, root = keyed["rm"], keyed["db"], keyed["alice"], keyed["root"]
    job, pg = _running_job(ray_local, rm, root, tmp_path)
    _kill_process_of(ray_local, "ResourceManager")  # the process dies; Ray restarts the manager (max_restarts)
    # a client's call (otray train's polling) rides out the restart: calls fail (ActorUnavailableError) until
    # the new process answers; the job failed at once, its lease freed; resumable from a checkpoint
    st = Client(rm, root).job(job).status()
    assert st.state == "FAILED" and st.error.startswith("ResourceManagerRestarted"), st
    assert report_failure(job, st) == 1  # `otray train` ends with that one line, not a traceback
    assert ray_local.get(rm.checkpoints.remote(job, root))
    deadline = time.time() + 30
    while ray_local.util.placement_group_table()[pg]["state"] != "REMOVED":
        assert time.time() < deadline, "the crashed job's placement group was not freed"
        time.sleep(0.5)
    assert ray_local.get(rm.auth_required.remote())
    with pytest.raises(AuthError, match="requires an API key"):
        ray_local.get(rm.jobs.remote())
    kill_resource_manager()
    with pytest.raises(ManagerGoneError, match="did not come back in 1 s"):  # gone for good: one clear error
        Client(rm, root, manager_wait_s=1).job(job).status()
    again = get_or_create(str(db), auth_enabled=False)  # a client asking for auth off
    assert ray_local.get(again.auth_required.remote())
    assert [j.id for j in ray_local.get(again.jobs.remote(alice))][:1] == [keyed["job"]]


def test_an_admin_allows_urls_through_the_cli_and_a_user_cannot(keyed, monkeypatch, capsys):
    """``otray urls allow URL`` (admin) then ``otray urls list``; a user's try is one error line, exit 2."""
    from otray.cli import main

    monkeypatch.setenv("OTRAY_DB", str(keyed["db"]))  # the keyed manager, found by name
    monkeypatch.setenv("OTRAY_API_KEY", keyed["root"])
    assert main(["urls", "allow", "http://10.0.0.6:9000/"]) == 0
    assert "http://10.0.0.6:9000" in capsys.readouterr().out.splitlines()
    monkeypatch.setenv("OTRAY_API_KEY", keyed["bob"])
    assert main(["urls", "allow", "http://10.0.0.7:9000"]) == 2
    assert "only an admin can allow URLs" in capsys.readouterr().err
    assert main(["urls", "list"]) == 0
    assert "http://10.0.0.7:9000" not in capsys.readouterr().out


def test_an_admin_sets_job_quotas_and_a_submit_past_one_is_refused_naming_it(keyed, ray_local, monkeypatch, capsys):
    """``otray users quota bob --jobs 0`` (admin): bob's next submit is refused naming the quota, before
    anything is queued; a user cannot set quotas; everyone else keeps the default of 16."""
    from otray.actors.control.resource_manager import NAME, NAMESPACE
    from otray.cli import main

    monkeypatch.setenv("OTRAY_DB", str(keyed["db"]))
    monkeypatch.setenv("OTRAY_API_KEY", keyed["root"])
    assert main(["users", "quota", "bob", "--jobs", "0"]) == 0
    assert "bob: 0 jobs" in capsys.readouterr().out
    rm = ray_local.get_actor(NAME, namespace=NAMESPACE)
    before = len(ray_local.get(rm.jobs.remote(keyed["bob"])))
    with pytest.raises(Exception, match="quota: bob has 0 jobs queued or running, the limit is 0"):
        ray_local.get(rm.submit.remote(user_cfg(None, None), keyed["bob"]))
    assert len(ray_local.get(rm.jobs.remote(keyed["bob"]))) == before
    monkeypatch.setenv("OTRAY_API_KEY", keyed["bob"])
    assert main(["users", "quota", "bob", "--jobs", "9"]) == 2
    assert "only an admin can set job quotas" in capsys.readouterr().err
    assert main(["users", "quota", "alice"]) == 0
    assert "alice: 16 jobs" in capsys.readouterr().out
    monkeypatch.setenv("OTRAY_API_KEY", keyed["root"])
    assert main(["users", "quota", "nobody", "--jobs", "1"]) == 2
    assert "no user 'nobody'" in capsys.readouterr().err


def test_a_key_check_the_gateway_kept_holds_until_a_key_changes(keyed, ray_local):
    """The Tinker gateway keeps the manager's answer that a key holds while the cluster's key epoch reads the
    same (otray.actors.control.epochs): five requests ask the manager once, and a rotation or a deletion is still
    refused at the very next request."""
    import asyncio

    from otray.actors.control.registry import tinker_key
    from otray.actors.control.resource_manager import NAME, NAMESPACE
    from otray.serve import http
    from otray.tinker.config import load_tinker
    from otray.tinker.errors import UserError
    from otray.tinker.gateway.callers import Callers

    rm, root = ray_local.get_actor(NAME, namespace=NAMESPACE), keyed["root"]  # (the crash test above restarts it)
    http._RM[:] = [None, 0.0]  # the gateway's lookup of the manager: made afresh
    dora = tinker_key(ray_local.get(rm.add_user.remote("dora", False, root)))
    callers = Callers(load_tinker({"auth": "on"}), None)

    async def scenario() -> None:
        for _ in range(5):
            assert await callers.key_owner(dora) == "dora"
        assert callers.checked.asked == 1
        new = tinker_key(ray_local.get(rm.rotate_key.remote(None, dora)))
        with pytest.raises(UserError, match="wrong API key") as refused:
            await callers.key_owner(dora)
        assert refused.value.status == 401
        assert await callers.key_owner(new) == "dora"
        ray_local.get(rm.delete_user.remote("dora", root))
        with pytest.raises(UserError, match="wrong API key"):
            await callers.key_owner(new)

    asyncio.run(scenario())
