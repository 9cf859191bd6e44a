"""``entry: verifiers`` (envs/verifiers_env.py) on verifiers environments the tests define
(tests/fixtures/vf_envs.py) and the bundled one (envs/vf_reverse_text.py), with the real ``verifiers``
package: single-turn, multi-turn and tool envs through check_env, the rubric as the reward, dataset
splits from the env's own datasets, aborted and hung rollouts as clear errors, and the trust rule."""

import json
import time

import pytest

from envs.verifiers_env import VerifiersEnv, VerifiersRolloutError, make_dataset
from otray import config
from otray.env import check_env, make
from otray.tools import ToolCall, format_tool_call
from otray.trust import BUNDLED_MODULES, Caller, ForbiddenConfigError, confine
from otray.types import ConfigError, Task

FIXTURE = "tests.fixtures.vf_envs"


def rows(tmp_path, kind):
    paths = make_dataset(tmp_path / kind, env_id=FIXTURE, env_args={"kind": kind})
    return {s: [json.loads(ln) for ln in p.read_text().splitlines()] for s, p in paths.items()}


def task(row):
    return Task(row["id"], "vf", row)


def test_single_turn_env_datasets_and_rubric(tmp_path):
    data = rows(tmp_path, "single")
    assert len(data["train"]) == 6 and len(data["eval"]) == 3  # the env's own train and eval datasets
    assert {r["answer"] for r in data["eval"]} == {"w100", "w101", "w102"}
    row = data["train"][0]
    check_env(make("verifiers", env_id=FIXTURE, env_args={"kind": "single"}), task(row), actions=[row["answer"]])
    env = VerifiersEnv(FIXTURE, {"kind": "single"})
    first, _ = env.reset(task(row))
    assert first == f"Say the word {row['answer']}." and env.system_prompt == "Repeat the word."
    right = env.step(row["answer"])
    assert right.done and right.reward == 1.0 and right.info["exact"] == 1.0 and right.info["correct"]
    env.reset(task(row))
    assert env.step("something else").reward == 0.0


def test_multi_turn_env_answers_each_turn(tmp_path):
    env = VerifiersEnv(FIXTURE, {"kind": "multi"})
    guess = Task("g", "vf", {"prompt": [{"role": "user", "content": "Guess my number (1-9)."}], "answer": "7"})
    check_env(env, guess, actions=["5", "8", "7"])
    assert env.reset(guess)[0] == "Guess my number (1-9)."
    assert env.step("5").observation == "higher"
    assert env.step("8").observation == "lower"
    last = env.step("7")
    assert last.done and last.reward == 1.0 and last.info["num_turns"] == 3.0
    env.reset(guess)
    assert [env.step(g).observation for g in ("1", "2")] == ["higher", "higher"]
    assert env.step("3").reward == 0.0


def test_tool_env_gets_otray_tool_calls_as_openai_tool_calls():
    env = VerifiersEnv(FIXTURE, {"kind": "tool"})
    add = Task("t", "vf", {"prompt": [{"role": "user", "content": "What is 20 + 22?"}], "answer": "42"})
    env.reset(add)
    assert [s["name"] for s in env.tool_specs] == ["add"] and env.tool_specs[0]["parameters"]["required"] == ["a", "b"]
    result = env.step("Let me add. " + format_tool_call(ToolCall("add", {"a": 20, "b": 22})))
    assert result.observation == "<tool_response>42</tool_response>" and not result.done
    final = env.step("42")
    assert final.reward == 1.0 and final.info["add_calls"] == 1.0 and final.info["total_tool_calls"] == 1.0


def test_aborted_and_hung_rollouts_are_errors_naming_the_cause():
    env = VerifiersEnv(FIXTURE, {"kind": "broken"})
    env.reset(Task("b", "vf", {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}))
    with pytest.raises(VerifiersRolloutError, match="the env's backend is down"):
        env.step("hello")
    hung = VerifiersEnv(FIXTURE, {"kind": "hang"}, timeout_s=1.5)
    hung.reset(Task("h", "vf", {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}))
    start = time.monotonic()
    with pytest.raises(VerifiersRolloutError, match="in 1.5 s"):
        hung.step("hello")
    assert time.monotonic() - start < 5
    hung.close()


def test_bad_names_and_rows_are_clear_errors():
    with pytest.raises(ConfigError, match="cannot load the verifiers environment 'no_such_env'"):
        VerifiersEnv("no_such_env").reset(Task("x", "vf", {"prompt": []}))
    with pytest.raises(ConfigError, match="has no 'prompt'"):
        VerifiersEnv(FIXTURE, {"kind": "single"}).reset(Task("x", "vf", {"question": "q"}))
    with pytest.raises(ConfigError, match="unknown key"):
        VerifiersEnv(FIXTURE, nope=1)


def test_a_users_env_id_is_an_import_path(tmp_path):
    def cfg(env_id):
        return config.load({"model": {"path": "tiny"}, "envs": {"vf": {
            "entry": "verifiers", "kwargs": {"env_id": env_id},
            "dataset": {"builder": "envs.verifiers_env:make_dataset", "dir": "d", "kwargs": {"env_id": env_id}},
            "splits": {"train": {}, "eval": {}}}}})

    alice = Caller("alice", False)
    confine(cfg("envs.vf_reverse_text"), alice, BUNDLED_MODULES, tmp_path)
    for env_id in ("antigravity", "some-hub/planted-env"):
        with pytest.raises(ForbiddenConfigError, match="not code this cluster lets users run"):
            confine(cfg(env_id), alice, BUNDLED_MODULES, tmp_path)
    confine(cfg("some-hub/planted-env"), alice, BUNDLED_MODULES | {"planted_env"}, tmp_path)  # once allowed
