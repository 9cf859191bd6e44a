"""ALFWorld through ``entry: alfworld`` (envs/alfworld_env.py) and the real ``alfworld`` package, on rooms
made here in ALFWorld's data layout (envs/alfworld_scenes.py) and turned into games by ALFWorld's own
``alfworld-generate`` (its download cannot be made here): the builder lists them through ALFWorld's own
``AlfredTWEnv``; the adapter passes check_env, its walkthroughs win, rewards and invalid actions are as
documented, a broken game is an error record; a user config may not name a data folder outside its area."""

import json
import shutil

import pytest

from envs.alfworld_env import AlfWorldEnv, alfworld_games, scene_demos
from envs.alfworld_scenes import make_scenes
from otray import config
from otray.actors.job.episodes import episode_metrics
from otray.env import check_env, resolve
from otray.trust import BUNDLED_MODULES, Caller, ForbiddenConfigError, confine
from otray.types import ConfigError, DatasetError, SamplingParams, Task, Trajectory

TYPES = ["pick_and_place_simple", "pick_heat_then_place_in_recep", "pick_clean_then_place_in_recep",
         "pick_cool_then_place_in_recep"]
SCENES = {"num_train": 4, "num_eval": 2, "task_types": TYPES}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Six rooms, their games from alfworld-generate (~3 s), and the walkthrough demonstrations."""
    out = tmp_path_factory.mktemp("alfworld")
    rows = make_scenes(out, **SCENES)
    demos = scene_demos(out, env_kwargs={"max_steps": 10}, **SCENES)
    return out, {s: [json.loads(ln) for ln in p.read_text().splitlines()] for s, p in rows.items()}, demos


def task(row):
    return Task(row["id"], "alfworld", row)


def test_rooms_become_alfworld_games_in_its_layout(built):
    out, rows, _ = built
    assert [len(rows["train"]), len(rows["eval"])] == [4, 2]
    assert {r["task_type"] for r in rows["train"]} == set(TYPES)
    assert all(r["id"].startswith("train/") for r in rows["train"])
    assert all(r["id"].startswith("valid_unseen/") for r in rows["eval"])
    for row in rows["train"] + rows["eval"]:
        game = json.loads(open(row["game"]).read())
        assert game["solvable"] is True and game["walkthrough"] == row["walkthrough"]  # ALFWorld's planner's plan
        assert len(row["walkthrough"]) >= 3  # go, take, go (, open), move: never won before the first step
        assert "(:domain alfred)" in game["pddl_problem"] and "UNKNOWN GOAL" not in game["grammar"]
    again = make_scenes(out, **SCENES)  # built once
    assert {p.read_text() for p in again.values()} == {p.read_text() for p in make_scenes(out, **SCENES).values()}


def test_the_walkthrough_wins_through_check_env_with_alfworlds_text(built):
    _, rows, _ = built
    row = rows["train"][0]
    check_env(resolve("alfworld")(max_steps=10), task(row), actions=row["walkthrough"] + ["look"])
    env = AlfWorldEnv(max_steps=10)
    first, info = env.reset(task(row))
    assert "Welcome to TextWorld, ALFRED!" in first and "Your task is to: " in first
    assert "Admissible commands: " in first and info["steps"] == 0 and not info["won"]
    rewards = []
    for command in row["walkthrough"]:
        result = env.step(f"> {command.capitalize()}.")
        rewards.append(result.reward)
    assert result.done and result.finished and result.info["won"] and result.info["correct"]
    assert rewards[-1] == 1.0 and sum(rewards[:-1]) == 0.0 and result.info["invalid_actions"] == 0


def test_opentinker_shaping_counts_invalid_actions(built):
    _, rows, _ = built
    row = rows["train"][1]
    env = AlfWorldEnv(reward_preset="opentinker", max_steps=20)
    env.reset(task(row))
    bad = env.step("fly to the moon")
    assert bad.observation.startswith("Nothing happens.") and bad.reward == pytest.approx(-0.11)
    for command in row["walkthrough"]:
        result = env.step(command)
    assert result.info["won"] and result.reward == pytest.approx(10 - 0.01)
    assert result.info["invalid_actions"] == 1 and result.info["steps"] == len(row["walkthrough"]) + 1
    turns = len(row["walkthrough"]) + 1
    metrics = episode_metrics([Trajectory(task(row), num_turns=turns, reward=10.0, info=result.info)], "eval/")
    assert metrics["eval/success_rate"] == 1.0 and metrics["eval/invalid_action_rate"] == pytest.approx(1 / turns)


def test_max_steps_ends_unfinished_and_admissible_can_be_hidden(built):
    _, rows, _ = built
    env = AlfWorldEnv(max_steps=2, admissible=False)
    first, _ = env.reset(task(rows["eval"][0]))
    assert "Admissible commands" not in first
    assert not env.step("look").done
    last = env.step("inventory")
    assert last.done and last.finished is False and not last.info["won"]


def test_domain_randomization_keeps_the_game_playable(built):
    _, rows, _ = built
    env = AlfWorldEnv(domain_randomization=True, max_steps=10)
    first, _ = env.reset(task(rows["train"][2]))
    assert "Your task is to:" in first
    with pytest.raises(ConfigError, match="unknown key.*'game'.*domain_randomization"):
        AlfWorldEnv(game="/etc/passwd")


def test_episodes_reuse_fast_downward_instead_of_loading_it_again(built):
    _, rows, _ = built
    first, second = AlfWorldEnv(), AlfWorldEnv()
    first.reset(task(rows["train"][0]))
    second.reset(task(rows["train"][1]))  # two games in play: two planners (its state is the library's)
    a, b = first._pddl, second._pddl
    assert a is not b
    first.close()
    third = AlfWorldEnv()
    third.reset(task(rows["train"][2]))
    assert third._pddl is a  # the idle one, not a new 34 MB library copy (which is never unloaded)
    assert third.step(rows["train"][2]["walkthrough"][0]).info["invalid_actions"] == 0
    second.close(), third.close()


def test_broken_games_are_clear_errors_and_error_records(built, tmp_path, tiny_path, tokenizer):
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.actors.rollout.agent_loop import AgentLoop, Limits

    _, rows, _ = built
    env = AlfWorldEnv()
    junk = tmp_path / "junk.tw-pddl"
    junk.write_text("not json")
    with pytest.raises(DatasetError, match="not an ALFWorld game file"):
        env.reset(Task("t", "alfworld", {"game": str(junk)}))
    junk.write_text(json.dumps({"pddl_domain": "x"}))
    with pytest.raises(DatasetError, match="no grammar, pddl_problem"):
        env.reset(Task("t", "alfworld", {"game": str(junk)}))
    good = json.loads(open(rows["train"][0]["game"]).read())
    bad = tmp_path / "bad.tw-pddl"
    bad.write_text(json.dumps({**good, "pddl_problem": good["pddl_problem"].replace("(:init", "(:init (oops")}))
    worker = RolloutWorker(tiny_path, "hf", max_model_len=512)
    loop = AgentLoop(tokenizer, worker.generate, Limits(max_turns=2, max_tokens_per_turn=6,
                                                        max_tokens_per_episode=12, max_model_len=512))
    broken, played = loop.run([(Task("b", "alfworld", {"game": str(bad)}), AlfWorldEnv(max_steps=2), 0),
                               (task(rows["train"][0]), AlfWorldEnv(max_steps=2), 1)],
                              SamplingParams(max_tokens=6, seed=0))
    assert broken.error is not None and "ALFWorld could not load this game" in broken.error.message
    assert played.error is None and played.info["steps"] == 2 and not played.info["won"]


def test_the_builder_reads_alfworld_data_where_alfworld_data_points(built, tmp_path, monkeypatch):
    out, rows, _ = built
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(DatasetError, match="alfworld-download.*ALFWORLD_DATA"):
        alfworld_games(tmp_path / "none")
    scenes = next(out.glob("scenes-*"))
    shutil.copytree(scenes, tmp_path / "data")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "data"))
    paths = alfworld_games(tmp_path / "rows", task_types=[1], num_train=1, eval_split="valid_unseen")
    train = [json.loads(ln) for ln in paths["train"].read_text().splitlines()]
    assert len(train) == 1 and train[0]["task_type"] == "pick_and_place_simple"
    with pytest.raises(ConfigError, match="task types"):
        alfworld_games(tmp_path / "rows", task_types=["juggle"])
    with pytest.raises(ConfigError, match="valid_seen and valid_unseen"):
        alfworld_games(tmp_path / "rows", eval_split="test")
    with pytest.raises(DatasetError, match="no solvable ALFWorld games"):  # no valid_seen rooms were made
        alfworld_games(tmp_path / "rows", eval_split="valid_seen")


def test_demonstrations_are_the_envs_own_conversation(built):
    _, rows, demos = built
    for split, path in demos.items():
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        assert len(lines) == len(rows[split])
        for line, row in zip(lines, rows[split]):
            assert [m["content"] for m in line["messages"] if m["role"] == "assistant"] == row["walkthrough"]


def test_a_user_config_names_alfworld_data_only_inside_its_area(tmp_path):
    def cfg(data):
        return config.load({"model": {"path": "tiny"}, "envs": {"alf": {
            "entry": "alfworld", "dataset": {"builder": "envs.alfworld_env:alfworld_games", "dir": "alf",
                                             "kwargs": {"data": data}},
            "splits": {"train": {}, "eval": {"shuffle": False}}}}})

    alice = Caller("alice", False)
    confine(cfg("my_alfworld"), alice, BUNDLED_MODULES, tmp_path)  # inside the user's dataset dir: fine
    for outside in ("/root/alfworld", "../bob/data", "~/data"):
        with pytest.raises(ForbiddenConfigError, match="dataset.kwargs.data.*outside your area"):
            confine(cfg(outside), alice, BUNDLED_MODULES, tmp_path)
    confine(cfg("/srv/alfworld"), Caller("root", True), BUNDLED_MODULES, tmp_path)  # an admin's data folder
