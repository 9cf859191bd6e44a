"""The SQLite registry: hashed keys, job lifecycle, checkpoints, persistence."""

import pytest

from otray.actors.control.registry import AuthError, JobState, JobStateError, Registry, tinker_key


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "otray.db")
    yield r
    r.close()


def test_keys_authenticate_and_are_never_stored(reg, tmp_path):
    alice = reg.add_user("alice")
    root = reg.add_user("root", admin=True)
    assert reg.authenticate(alice).name == "alice" and not reg.authenticate(alice).admin
    assert reg.authenticate(root).admin
    reg.close()
    raw = (tmp_path / "otray.db").read_bytes()
    for key in (alice, root):
        assert key.encode() not in raw and key.split("_", 2)[2].encode() not in raw


@pytest.mark.parametrize("key, match", [
    (None, "requires an API key"), ("", "requires an API key"), ("hello", "malformed"),
    ("otr_x_abc", "malformed"), ("otr_1_wrongsecret", "wrong API key"), ("otr_99_abc", "wrong API key"),
])
def test_bad_keys_are_refused(reg, key, match):
    reg.add_user("alice")
    with pytest.raises(AuthError, match=match):
        reg.authenticate(key)


def test_the_tinker_spelling_of_a_key_is_the_same_key(reg):
    key = reg.add_user("alice")
    other = reg.add_user("bob")
    assert tinker_key(key).startswith("tml-") and reg.authenticate(tinker_key(key)).name == "alice"
    assert reg.authenticate(tinker_key(other)).name == "bob"
    with pytest.raises(AuthError, match="wrong API key"):
        reg.authenticate(tinker_key(key)[:-2] + "xx")
    with pytest.raises(AuthError, match="malformed"):
        reg.authenticate("tml-local")
    reg.rotate_key("alice")
    with pytest.raises(AuthError, match="wrong API key"):
        reg.authenticate(tinker_key(key))


def test_duplicate_and_bad_user_names(reg):
    reg.add_user("alice")
    with pytest.raises(ValueError, match="already exists"):
        reg.add_user("alice")
    with pytest.raises(ValueError, match="letters, digits"):
        reg.add_user("a b")


def test_job_lifecycle_and_timestamps(reg):
    job = reg.create_job("alice", "demo", {"algo": {"steps": 2}})
    assert reg.job(job).state is JobState.QUEUED
    reg.set_state(job, JobState.STARTING)
    rec = reg.set_state(job, JobState.RUNNING)
    assert rec.started is not None and rec.finished is None
    rec = reg.set_state(job, JobState.FAILED, error="learner died")
    assert rec.state.terminal and rec.error == "learner died" and rec.finished >= rec.started
    assert [s for s, _ in rec.transitions] == ["QUEUED", "STARTING", "RUNNING", "FAILED"]
    with pytest.raises(JobStateError, match="cannot go from FAILED to RUNNING"):
        reg.set_state(job, JobState.RUNNING)
    with pytest.raises(JobStateError, match="QUEUED to SUCCEEDED"):
        reg.set_state(reg.create_job("alice", "x", {}), JobState.SUCCEEDED)


def test_jobs_by_owner_checkpoints_and_reopen(reg, tmp_path):
    a = reg.create_job("alice", "a", {})
    reg.create_job("bob", "b", {})
    assert [j.owner for j in reg.jobs("alice")] == ["alice"] and len(reg.jobs()) == 2
    reg.add_checkpoint(a, 2, "/ck/2")
    reg.add_checkpoint(a, 4, "/ck/4")
    assert reg.checkpoint(a) == (4, "/ck/4") and reg.checkpoint(a, 2) == (2, "/ck/2")
    with pytest.raises(KeyError, match="no checkpoint at step 3"):
        reg.checkpoint(a, 3)
    reg.set_progress(a, {"step": 4, "reward_mean": 0.5})
    reg.close()
    again = Registry(tmp_path / "otray.db")  # a restarted ResourceManager reads the same state
    assert again.job(a).progress == {"step": 4, "reward_mean": 0.5}
    assert again.checkpoint(a) == (4, "/ck/4")
    with pytest.raises(KeyError, match="no job"):
        again.job("nope")
    again.close()


def test_rows_after_a_rewind_past_a_kept_recovery_row_are_recorded_in_order(reg):
    """A job that replaced a rollout worker at step 5 (a ``recovery`` row, kept by a rewind) and then restarted
    from its step-3 checkpoint: the steps it runs again are recorded after the recovery rows, each once, and a
    reader of the rows from an index on (``metrics(job, since)``) gets them. (A row's index was the job's row
    count, which a rewind lowers under the kept recovery row's: the second step after the restart collided with
    it, ``IntegrityError``.)"""
    job = reg.create_job("alice", "demo", {})
    for step in range(1, 11):
        reg.set_progress(job, {"step": step})
        if step == 5:
            reg.set_progress(job, {"step": 5, "phase": "recovery", "workers": 1})
    reg.rewind(job, 3)
    reg.set_progress(job, {"step": 3, "phase": "recovery", "failure": 1})
    for step in range(4, 8):
        reg.set_progress(job, {"step": step})
    rows = reg.metrics(job)
    assert [(r["step"], r.get("phase")) for r in rows] == [
        (1, None), (2, None), (3, None), (5, "recovery"), (3, "recovery"), (4, None), (5, None), (6, None), (7, None)]
    assert [r["step"] for r in reg.metrics(job, 4)] == [3, 4, 5, 6, 7]  # from the fifth row on
    assert reg.job(job).progress == {"step": 7}


def test_a_follower_by_cursor_sees_the_steps_a_restart_runs_again(reg):
    """``metrics_after``: a follower that read up to step 6 before a restart to step 3 gets the restart's
    recovery row and steps 4-6 run again, then the new ones, each once; the rewind's dropped indices are not
    given again (a follower counting rows missed the rows until the count passed what it had read)."""
    job = reg.create_job("alice", "demo", {})
    for step in range(1, 7):
        reg.set_progress(job, {"step": step})
    page = reg.metrics_after(job)
    assert [r["step"] for r in page.rows] == [1, 2, 3, 4, 5, 6]
    assert reg.metrics_after(job, page.cursor).rows == [] and reg.metrics_after(job, page.cursor).cursor == page.cursor
    reg.rewind(job, 3)
    reg.set_progress(job, {"step": 3, "phase": "recovery", "failure": 1})
    for step in range(4, 8):
        reg.set_progress(job, {"step": step})
    after = reg.metrics_after(job, page.cursor)
    assert [(r["step"], r.get("phase")) for r in after.rows] == [(3, "recovery"), (4, None), (5, None), (6, None),
                                                                  (7, None)]
    assert [r["step"] for r in reg.metrics(job, 6)] == [6, 7]  # by count: the recovery row, 4 and 5 missed
    reg.rewind(job, 5)  # a second restart with no row between: its rows still come after every index given
    reg.set_progress(job, {"step": 6})
    assert [r["step"] for r in reg.metrics_after(job, after.cursor).rows] == [6]
    assert [r["step"] for r in reg.metrics_after(job, -1, limit=2).rows] == [1, 2]
