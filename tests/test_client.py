"""Driver API and auth through a ResourceManager with auth on; the `otray` CLI's exit codes."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otray.actors.control.registry import AuthError
from otray.types import ConfigError
from tests.conftest import fresh_resource_manager, kill_resource_manager
from tests.fixtures.jobs import user_cfg

from tests.conftest import ROOT  # noqa: E402 (the repository root)


@pytest.fixture(scope="module")
def cluster(ray_local, tmp_path_factory):
    from otray.client import connect

    db = tmp_path_factory.mktemp("auth") / "registry.db"
    fresh_resource_manager(db, auth_enabled=True)
    admin_client = connect(db_path=str(db), auth_enabled=True)
    admin_key = admin_client.add_user("root")  # the first user becomes an admin
    admin_client.api_key = admin_key
    yield admin_client, db
    kill_resource_manager()


def test_submit_wait_metrics_and_ownership(cluster, tmp_path, tiny_path):
    from otray.client import Client

    admin, db = cluster
    alice = Client(admin.rm, admin.add_user("alice"))
    bob = Client(admin.rm, admin.add_user("bob"))
    job = alice.submit(user_cfg(tmp_path, tiny_path))
    final = job.wait(timeout=180)
    assert final.state == "SUCCEEDED" and final.owner == "alice"
    rows = job.metrics()
    assert [r["phase"] for r in rows] == ["init", "grpo", "grpo"] and rows[-1]["step"] == 2
    page = job.metrics_after()  # a follower's read (otray train's table), then nothing new after its cursor
    assert page.rows == rows and job.metrics_after(page.cursor).rows == []
    # bob can neither see nor cancel alice's job; the admin can see it
    with pytest.raises(KeyError, match="no job .* of yours"):  # answered like an id that does not exist
        bob.job(job.id).status()
    with pytest.raises(KeyError, match="no job .* of yours"):
        bob.job(job.id).metrics_after()
    with pytest.raises(KeyError, match="no job .* of yours"):
        bob.job(job.id).cancel()
    assert [j.id for j in bob.jobs()] == []
    assert job.id in [j.id for j in admin.jobs()]
    assert admin.job(job.id).status().state == "SUCCEEDED"
    with pytest.raises(AuthError, match="only an admin"):
        bob.add_user("mallory")
    raw = Path(db).read_bytes()
    assert alice.api_key.encode() not in raw and bob.api_key.encode() not in raw


def test_owner_cancels_and_bad_keys_change_nothing(cluster, tmp_path, tiny_path):
    from otray.client import Client

    admin, _ = cluster
    carol = Client(admin.rm, admin.add_user("carol"))
    job = carol.submit(user_cfg(tmp_path, tiny_path, steps=500))
    before = len(admin.jobs())
    for key in (None, "otr_1_wrong", "garbage"):
        with pytest.raises(AuthError):
            Client(admin.rm, key).submit(user_cfg(tmp_path, tiny_path))
        with pytest.raises(AuthError):
            Client(admin.rm, key).job(job.id).cancel()
    assert len(admin.jobs()) == before
    time.sleep(1)
    assert carol.job(job.id).cancel().state == "CANCELLED"


def test_bad_config_fails_at_submit_naming_the_key(cluster, tmp_path, tiny_path):
    admin, _ = cluster
    bad = user_cfg(tmp_path, tiny_path)
    bad["algo"]["learnig_rate"] = 1.0
    with pytest.raises(ConfigError, match="did you mean 'algo.learning_rate'"):
        admin.submit(bad)


@pytest.mark.service  # three `otray` processes
def test_cli_exit_codes(tmp_path):
    otray = [sys.executable, "-m", "otray.cli"]
    bad = subprocess.run([*otray, "train", str(ROOT / "conf" / "arithmetic_grpo.yaml"), "algo.stepz=3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "did you mean 'algo.steps'" in bad.stderr
    missing = subprocess.run([*otray, "train", str(tmp_path / "nope.yaml")], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    built = subprocess.run([*otray, "tiny-model", str(tmp_path / "m")], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0 and (tmp_path / "m" / "config.json").exists()


@pytest.mark.parametrize("argv, says", [
    (["serve", "port=notaport"], "port"),  # an override, not a config file named 'port=notaport'
    (["tinker", "port=notaport"], "port"),
    (["serve", "port=1", "host=[]"], "host"),
    (["train", "algo.steps=3"], "needs a config file"),
    (["infer", "algo.steps=3"], "needs a config file"),
])
def test_an_argument_with_an_equals_sign_is_an_override_never_a_config_file(argv, says, capsys):
    """``otray serve port=8001`` has no config file and one override (it used to look for a file named
    'port=8001'); bad values fail at load, before any cluster is touched, with exit 2 and one error line."""
    from otray.cli import config_and_overrides, main

    assert config_and_overrides("port=8001", ["host=0.0.0.0"], required=False) == (None, ["port=8001", "host=0.0.0.0"])
    assert config_and_overrides("conf/x.yaml", ["port=1"], required=True) == ("conf/x.yaml", ["port=1"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "does not exist" not in err, err


def test_resume_from_job_id_and_step(cluster, tmp_path, tiny_path):
    from otray.client import Client

    admin, db = cluster
    dave = Client(admin.rm, admin.add_user("dave"))
    data = user_cfg(tmp_path, tiny_path, steps=2)
    data["checkpoint"] = {"save_every": 1}
    first = dave.submit(data)
    assert first.wait(timeout=180).state == "SUCCEEDED"
    # the registered copy lives in the ResourceManager's store; remove the job's own copy so
    # that the resumed job can only get it through Ray
    local = Path(db).parent / "users" / "dave" / "runs" / first.id / "checkpoints"  # a user's jobs: their area
    assert (local / "step-000001" / "state").is_dir()
    shutil.rmtree(local)
    got = first.download_checkpoint(tmp_path / "fetched", step=1)
    assert (got / "state" / "meta.json").exists() and (got / "model" / "config.json").exists()
    eve = Client(admin.rm, admin.add_user("eve"))
    stolen = user_cfg(tmp_path, tiny_path)
    stolen["checkpoint"] = {"resume_from": f"{first.id}:1"}
    with pytest.raises(ConfigError, match="no job .* of yours"):
        eve.submit(stolen)
    with pytest.raises(KeyError, match="no job .* of yours"):
        eve.job(first.id).download_checkpoint(tmp_path / "nope")
    resumed_cfg = user_cfg(tmp_path, tiny_path, steps=2)
    resumed_cfg["checkpoint"] = {"resume_from": f"{first.id}:1", "save_at_end": False}
    second = dave.submit(resumed_cfg)
    assert second.wait(timeout=180).state == "SUCCEEDED"
    grpo = [r for r in second.metrics() if r["phase"] == "grpo"]
    assert [r["step"] for r in grpo] == [2]
    assert grpo[0]["batch"] == [r for r in first.metrics() if r.get("step") == 2 and r["phase"] == "grpo"][0]["batch"]
    bad = user_cfg(tmp_path, tiny_path)
    bad["checkpoint"] = {"resume_from": f"{first.id}:7"}
    with pytest.raises(ConfigError, match="no checkpoint at step 7"):
        dave.submit(bad)


def test_cli_auth_errors_are_one_line_and_exit_2(cluster, capsys):
    """``otray jobs`` with a wrong or deleted key and ``otray users add`` without an admin key print one
    ``error:`` line naming the problem and exit 2 (they ended in Ray tracebacks)."""
    from otray.cli import main

    admin, _ = cluster
    gone = admin.add_user("temp")
    import ray

    ray.get(admin.rm.delete_user.remote("temp", api_key=admin.api_key))
    for argv in (["--api-key", "otr_1_wrong", "jobs"], ["--api-key", gone, "jobs"], ["users", "add", "mallory"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_the_cli_says_why_a_queued_job_waits_when_the_reason_changes_not_every_poll():
    from otray.cli import Told

    told = Told(first_s=0.0, every_s=0.0)
    assert told.due("behind job A") and not told.due("behind job A")  # the same reason: said once
    assert told.due("it needs CPU 3 (free now 1)")
    quiet = Told(first_s=3600.0)
    assert not quiet.due("behind job A")  # a job placed within seconds is not talked about
    slow = Told(first_s=0.0, every_s=3600.0)
    assert slow.due("it needs CPU 3 (free now 1)") and not slow.due("it needs CPU 3 (free now 2)")
