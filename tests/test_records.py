"""The control plane's records (otray/records.py): every one crosses actors by pickle, JobStatus and
CheckpointMeta as JSON, and terminal states are defined once."""

import dataclasses
import json
import pickle

import pytest

from otray import records as R


def _examples():
    return [
        R.JobStatus("j1", "alice", "demo", R.JobState.RUNNING, None, "rl", 150, {"step": 3, "reward_mean": 0.5},
                    1.0, 2.0, None),
        R.UserInfo("alice", False),
        R.Identity("alice", True, True),
        R.ServableJob("j1", 1.0, "tiny", [10, 20]),
        R.EpisodePage([1, 2], [{"task": "t", "reward": 1.0}]),
        R.MetricsPage([{"step": 1, "phase": "grpo"}], 4),
        R.CheckpointMeta(3, 3, {"rank": 8}, "tiny", {"job_step": 3}, sharded=2, optimizer=True),
    ]


@pytest.mark.parametrize("value", _examples(), ids=lambda v: type(v).__name__)
def test_pickle_round_trip(value):
    assert pickle.loads(pickle.dumps(value)) == value


def test_every_record_is_covered():
    covered = {type(v) for v in _examples()}
    declared = {o for o in vars(R).values() if dataclasses.is_dataclass(o) and o.__module__ == R.__name__}
    assert declared <= covered, f"add an example for {declared - covered}"


def test_terminal_states_are_defined_once_and_statuses_are_json():
    assert {s for s in R.JobState if s.terminal} == R.TERMINAL_STATES == {
        R.JobState.SUCCEEDED, R.JobState.FAILED, R.JobState.CANCELLED}
    st = _examples()[0]
    data = json.loads(json.dumps(st.to_json()))
    assert data["state"] == "RUNNING" and data["progress"]["step"] == 3 and not st.terminal and not st.succeeded
    assert R.JobState("SUCCEEDED") is R.JobState.SUCCEEDED and R.JobState.FAILED == "FAILED"


def test_checkpoint_meta_reads_old_and_new_meta_json():
    old = {"step": 5, "version": 5, "lora": {"rank": 0}, "model_path": "tiny", "extra_state": {}}  # single learner
    meta = R.CheckpointMeta.from_json(old)
    assert (meta.sharded, meta.optimizer, meta.lora_rank) == (0, True, 0)
    new = R.CheckpointMeta.from_json({**old, "sharded": 2, "optimizer": False, "ignored": 1})
    assert (new.sharded, new.optimizer) == (2, False)
    assert R.CheckpointMeta.from_json(new.to_json()) == new
