"""TextWorld games through ``entry: textworld`` (envs/textworld_env.py) on games the real ``textworld``
generator makes here (envs/textworld_games.py): the adapter through check_env, rewards, invalid actions,
limits, damaged files, the dataset builder and the walkthrough demonstrations."""

import json
from pathlib import Path

import pytest

from envs.textworld_env import PRESETS, TextWorldEnv, clean_feedback, parse_command
from envs.textworld_games import make_demos, make_games, play_walkthrough
from otray.actors.job.episodes import episode_metrics
from otray.env import check_env, resolve
from otray.types import ConfigError, DatasetError, Task, Trajectory

GAMES = {"challenge": "tw-treasure_hunter", "settings": {"level": 2}, "num_train": 3, "num_eval": 2}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Five distinct generated games (~5 s) and their demonstrations."""
    out = tmp_path_factory.mktemp("tw")
    demos = make_demos(out, env_kwargs={"max_steps": 6}, **GAMES)
    rows = make_games(out, **GAMES)
    return out, {s: [json.loads(ln) for ln in p.read_text().splitlines()] for s, p in rows.items()}, demos


def task(row):
    return Task(row["id"], "textworld", row)


def test_builder_makes_distinct_games_per_split_and_is_idempotent(built):
    out, rows, _ = built
    assert [len(rows["train"]), len(rows["eval"])] == [3, 2]
    games = [r["game"] for split in rows.values() for r in split]
    assert len(set(games)) == 5 and all(Path(g).is_file() for g in games)
    assert all(r["walkthrough"] and r["objective"] for split in rows.values() for r in split)
    again = make_games(out, **GAMES)  # built once: the same files, untouched
    before = {p.stat().st_mtime_ns for p in again.values()}
    assert {p.stat().st_mtime_ns for p in make_games(out, **GAMES).values()} == before
    # other arguments build beside the old ones, never reuse them
    other = make_games(out, **{**GAMES, "num_train": 1, "num_eval": 1})
    assert other["train"].parent != again["train"].parent


def test_builder_can_keep_only_games_with_short_openings(tmp_path):
    rows = make_games(tmp_path, **{**GAMES, "num_train": 2, "num_eval": 1}, max_opening_chars=420)
    kept = [json.loads(ln) for p in rows.values() for ln in p.read_text().splitlines()]
    assert len(kept) == 3
    env = TextWorldEnv()
    assert all(len(env.reset(task(r))[0]) <= 420 for r in kept)
    env.close()
    assert len(list((rows["train"].parent / "games").glob("*.z8"))) == 3  # skipped games leave no files


def test_builder_errors_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="unknown TextWorld challenge 'tw-nope'.*tw-treasure_hunter"):
        make_games(tmp_path, challenge="tw-nope")
    with pytest.raises(ConfigError, match="level"):  # treasure hunter requires it
        make_games(tmp_path, challenge="tw-treasure_hunter", settings={})


def test_adapter_passes_check_env_and_the_walkthrough_wins(built):
    _, rows, _ = built
    row = rows["train"][0]
    check_env(resolve("textworld")(max_steps=6), task(row), actions=row["walkthrough"] + ["look"])
    env = TextWorldEnv(max_steps=6)
    first, info = env.reset(task(row))
    assert row["objective"].split(".")[0] in first and "Admissible commands:" in first
    assert "$$" not in first and info["steps"] == 0
    rewards = []
    for cmd in row["walkthrough"]:
        result = env.step(f"> {cmd.upper()}.")  # prompt marks, case and a period are not part of the command
        rewards.append(result.reward)
    assert result.done and result.finished and result.info["won"] and result.info["correct"]
    assert sum(rewards) == pytest.approx(1.0) and result.info["invalid_actions"] == 0
    assert result.info["steps"] == len(row["walkthrough"])


def test_invalid_actions_are_counted_sent_and_shaped(built):
    _, rows, _ = built
    row = rows["eval"][0]
    env = TextWorldEnv(reward_preset="opentinker", max_steps=6)
    env.reset(task(row))
    assert env.step("\ufffdy re\ufffday re\ufffd\ufffd a numberuess\x00").info["invalid_actions"] == 1  # (crashed before)
    bad = env.step("dance wildly")
    assert not bad.done and bad.info["invalid_actions"] == 2
    assert bad.reward == pytest.approx(-0.11)  # a step (-0.01) and an invalid action (-0.1)
    assert "dance" not in bad.observation.split("Admissible commands:")[1]  # the game's own answer, then the list
    for cmd in row["walkthrough"]:
        result = env.step(cmd)
    assert result.info["won"] and result.reward == pytest.approx(PRESETS["opentinker"]["win_reward"] - 0.01)
    trajs = [Trajectory(task(row), num_turns=2 + len(row["walkthrough"]), reward=1.0, info=result.info)]
    metrics = episode_metrics(trajs, "eval/")
    assert metrics["eval/success_rate"] == 1.0
    assert metrics["eval/invalid_action_rate"] == pytest.approx(2 / (2 + len(row["walkthrough"])))


def test_max_steps_ends_the_game_unfinished_and_admissible_can_be_hidden(built):
    _, rows, _ = built
    env = TextWorldEnv(max_steps=2, admissible=False)
    first, _ = env.reset(task(rows["train"][1]))
    assert "Admissible commands" not in first
    assert not env.step("look").done
    last = env.step("inventory")
    assert last.done and last.finished is False and not last.info["won"] and last.info["steps"] == 2
    with pytest.raises(Exception, match="before reset|after the episode"):
        env.step("look")


def test_bad_games_and_kwargs_are_clear_errors_not_a_dead_process(built, tmp_path):
    _, rows, _ = built
    env = TextWorldEnv()
    with pytest.raises(DatasetError, match="no 'game'"):
        env.reset(Task("t", "textworld", {}))
    with pytest.raises(DatasetError, match="does not exist"):
        env.reset(Task("t", "textworld", {"game": str(tmp_path / "gone.z8")}))
    junk = tmp_path / "junk.z8"
    junk.write_bytes(b"\x42" * 500)  # TextWorld's interpreter would end this process on it
    with pytest.raises(DatasetError, match="not a Z-machine"):
        env.reset(Task("t", "textworld", {"game": str(junk)}))
    damaged = tmp_path / "damaged.z8"
    data = bytearray(Path(rows["train"][0]["game"]).read_bytes())
    data[5000] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="damaged"):
        env.reset(Task("t", "textworld", {"game": str(damaged)}))
    with pytest.raises(ConfigError, match="unknown key.*'game'"):
        TextWorldEnv(game="/etc/passwd")
    with pytest.raises(ConfigError, match="reward_preset 'nope'"):
        TextWorldEnv(reward_preset="nope")


def test_demonstrations_are_the_envs_own_conversation(built):
    _, rows, demos = built
    for split, path in demos.items():
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        assert len(lines) == len(rows[split])
        for line, row in zip(lines, rows[split]):
            msgs = line["messages"]
            assert msgs[0]["role"] == "system" and msgs[-1]["role"] == "assistant"
            assert [m["content"] for m in msgs if m["role"] == "assistant"] == row["walkthrough"]
            assert msgs == play_walkthrough(row, {"max_steps": 6})[0]


@pytest.mark.parametrize("text,command", [
    ("go north", "go north"), ("> Take  Key.\nbecause it is there", "take key"), ("Action: open door", "open door"),
    ("\n\n`look`", "look"), ("", ""), ("'inventory'", "inventory"),
    ("\ufffdy re\ufffd a number\x00", "y re a number"), ("go " * 100, ("go " * 100)[:200])])
def test_parse_command(text, command):
    assert parse_command(text) == command


def test_clean_feedback_drops_the_banner_and_status_bar():
    raw = "\n\n  | $$   | $$  \\\\  \n Welcome!\n\n\n\n-= Room =-\nA room.\n\n>    -= Room =-0/1"
    assert clean_feedback(raw) == "Welcome!\n\n-= Room =-\nA room."
