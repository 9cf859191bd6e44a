"""Game jobs on a local Ray cluster: a killed rollout worker mid-phase, frozen opponents
(a checkpoint directory, and a registered JOB_ID through the ResourceManager)."""

import json
from pathlib import Path

import pytest

from otray import config
from tests.conftest import fresh_resource_manager, kill_resource_manager

from tests.conftest import ROOT  # noqa: E402 (the repository root)
TINY_GAME = ["algo.steps=1", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=4", "sft.steps=1",
             "sft.batch_size=2", "eval.every=0", "sft.eval_samples=8"]


def _coordinator(policies, tokenizer):
    from pettingzoo.classic import tictactoe_v3

    from envs.tictactoe_text import TEXT
    from otray.actors.rollout.agent_loop import Limits
    from otray.actors.rollout.protocol import ProtocolCoordinator
    from otray.actors.rollout.text_bridge import MoveRules

    return ProtocolCoordinator(tictactoe_v3.env, TEXT, policies, tokenizer, rules=MoveRules(max_retries=0),
                               limits=Limits(max_turns=100, max_tokens_per_turn=6, max_tokens_per_episode=100,
                                             max_model_len=512))


def test_a_rollout_worker_killed_mid_phase_is_routed_around(ray_local, tiny_path, tokenizer):
    import ray

    from otray.actors.sampling.rollout import RolloutWorker, wait_ready
    from otray.actors.sampling.fleet import RolloutFleet
    from otray.actors.rollout.protocol import Policy
    from otray.types import SamplingParams

    workers = [ray.remote(num_cpus=1)(RolloutWorker).remote(tiny_path, "hf", max_model_len=512, seed=i)
               for i in range(2)]
    wait_ready(workers)
    fleet, calls = RolloutFleet(workers), []

    def generate(prompts, params, n):
        calls.append(len(prompts))
        if len(calls) == 3:  # third phase: worker 1 dies with the phase's decisions pending
            ray.kill(workers[1])
        return fleet.generate(prompts, params, n)

    model = Policy("model", generate=generate, params=SamplingParams(max_tokens=6, temperature=1.0))
    coord = _coordinator({"player_1": model, "player_2": Policy("random")}, tokenizer)
    results = coord.run(range(12))
    assert len(calls) > 3 and calls[2] > 1  # the kill hit a batched phase, and later phases ran
    assert list(fleet.dead) == [1] and "RayActorError" in fleet.dead[1] or "ActorDied" in fleet.dead[1]
    for game in results:  # every game played to the end on the surviving worker
        assert game.error is None and sum(game.rewards.values()) == 0
        assert game.trajectories["player_1"].num_turns == sum(a == "player_1" for a, _ in game.moves)
    # with no worker left, the games are recorded as errored: the run returns, nothing hangs
    ray.kill(workers[0])
    results = coord.run(range(3))
    assert all(r.error is not None and r.error.kind == "rollout_failed" for r in results)
    assert "every rollout worker failed" in results[0].error.message


def _metrics(job_dir):
    return [json.loads(line) for line in (Path(job_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ttt_checkpoint(ray_local, tmp_path_factory):
    """A one-step tic-tac-toe job's final checkpoint directory."""
    from otray.actors.job.run import run

    out = tmp_path_factory.mktemp("ttt")
    cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml", TINY_GAME + [f"job.output_dir={out}"])
    return run(cfg, out / cfg.job.name)["last_checkpoint"]


def test_frozen_opponent_from_a_checkpoint_directory(ray_local, tmp_path, ttt_checkpoint):
    from otray.actors.job.run import run

    spec = f"frozen:{ttt_checkpoint}"
    cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml",
                      TINY_GAME + [f"job.output_dir={tmp_path}", f"game.policies.player_2={spec}",
                                   f"game.eval_opponents=[random,'{spec}']", "sft.steps=0"])
    from otray.actors.control.resource_manager import bundles_for

    assert len(bundles_for(cfg)) == 3  # learner, its rollout worker, the frozen policy's worker
    run(cfg, tmp_path / "frozen")
    last = _metrics(tmp_path / "frozen")[-1]
    assert last["games"] == 8 and last["games_errored"] == 0
    for role in ("player_1", "player_2"):
        assert f"eval/{role}_vs_frozen-step-000001/win_rate" in last and f"eval/{role}_vs_random/win_rate" in last
    bad = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml",
                      TINY_GAME + [f"job.output_dir={tmp_path}", f"game.policies.player_2=frozen:{tmp_path}/none"])
    from otray.types import ModelLoadError

    with pytest.raises(ModelLoadError, match="no model there"):
        run(bad, tmp_path / "bad")


def test_frozen_opponent_by_job_id_through_the_resource_manager(ray_local, tmp_path, tiny_path):
    import time

    import ray

    rm = fresh_resource_manager(tmp_path / "registry.db")
    try:
        base = config.to_dict(config.load(ROOT / "conf" / "tictactoe_vs_random.yaml",
                                          TINY_GAME + [f"job.output_dir={tmp_path}/runs", f"model.path={tiny_path}"]))
        first = ray.get(rm.submit.remote(base))

        def wait(job_id):
            deadline = time.time() + 300
            while time.time() < deadline:
                st = ray.get(rm.status.remote(job_id))
                if st.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    return st
                time.sleep(0.5)
            raise AssertionError(f"job {job_id} did not finish")

        assert wait(first).state == "SUCCEEDED"
        second = dict(base, game={**base["game"], "policies": {"player_1": "trained", "player_2": f"frozen:{first}"}},
                      sft={**base["sft"], "steps": 0})
        job_id = ray.get(rm.submit.remote(second))
        stored = ray.get(rm.status.remote(job_id))
        st = wait(job_id)
        assert st.state == "SUCCEEDED", st
        # pinned at submit to the step that existed then, and fetched through Ray into the job's dir
        cfg_json = json.loads((Path(tmp_path) / "runs" / job_id / "config.json").read_text())
        assert cfg_json["game"]["policies"]["player_2"] == f"frozen:{first}:1", stored
        with pytest.raises(Exception, match="not the job token"):  # only the job's own driver, while it runs
            ray.get(rm.ref_blob.remote(job_id, f"{first}:0"))
    finally:
        kill_resource_manager()


def test_otray_infer_runs_the_training_env_code(ray_local, tmp_path, ttt_checkpoint, monkeypatch):
    """``otray infer`` submits an inference job to the ResourceManager (leased like a training job),
    which runs the training env code and keeps its rows for the submitter."""
    monkeypatch.setenv("OTRAY_DB", str(tmp_path / "registry.db"))  # the CLI's ResourceManager: this test's own
    fresh_resource_manager(tmp_path / "registry.db")
    try:
        _infer_through_the_cli(ray_local, tmp_path, ttt_checkpoint)
    finally:
        kill_resource_manager()


def _infer_through_the_cli(ray_local, tmp_path, ttt_checkpoint):
    from otray.cli import main
    from otray.client import connect

    runs = f"job.output_dir={tmp_path}/runs"
    out = tmp_path / "games.jsonl"
    assert main(["infer", str(ROOT / "conf" / "tictactoe_vs_random.yaml"), "--checkpoint", ttt_checkpoint,
                 "--limit", "3", "--out", str(out), "game.eval_opponents=[random]", runs]) == 0
    games = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(games) == 3 * 2  # 3 seeds x 2 roles against random
    for g in games:
        assert sum(g["rewards"].values()) == 0 and g["seating"][g["role"]] == "trained:main"
        mine = [e for e in g["episodes"] if e["agent"] == g["role"]]
        assert len(mine) == 1 and mine[0]["messages"][0]["role"] == "user" and mine[0]["reward"] == g["rewards"][g["role"]]
    out = tmp_path / "arith.jsonl"
    assert main(["infer", str(ROOT / "conf" / "arithmetic_grpo.yaml"), "--limit", "4", "--out", str(out),
                 f"envs.arithmetic.dataset.dir={tmp_path}/data", runs]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["prompt"].endswith("=") and "expected" in r["info"] for r in rows)
    # it was a job of the ResourceManager's: listed, finished, its episodes in the viewer, its placement group gone
    client = connect()
    job = max((j for j in client.jobs() if j.kind == "infer" and j.name == "arithmetic_grpo"),
              key=lambda j: j.created)
    assert job.state == "SUCCEEDED" and job.progress["rows"] == 4 and job.progress["phase"] == "infer"
    viewer = ray_local.get(client.rm.episodes.remote(job.id))
    assert [e["task"] for e in viewer.episodes] == [r["task"] for r in rows]
    assert ray_local.get(client.rm.placement_group_id.remote(job.id)) is None
    assert (tmp_path / "runs" / job.id / "inference.jsonl").read_text().count("\n") == 4
    assert main(["infer", str(ROOT / "conf" / "arithmetic_grpo.yaml"), "--split", "nope", "--out", str(out),
                 f"envs.arithmetic.dataset.dir={tmp_path}/data", runs]) == 2  # a clear error naming the splits
    # a visual env: the tiny VLM answers about pictures; each row (and the viewer's episode) carries them
    from otray.vision import Image

    out = tmp_path / "shapes.jsonl"
    assert main(["infer", str(ROOT / "conf" / "count_shapes.yaml"), "--limit", "3", "--out", str(out), runs]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["error"] is None and "<image>" in r["prompt"] for r in rows), rows
    assert all(len(r["images"]) == 1 and Image.from_data_url(r["images"][0]).to_pil().size == (56, 56) for r in rows)
    job = max((j for j in client.jobs() if j.kind == "infer" and j.name == "count_shapes"), key=lambda j: j.created)
    viewer = ray_local.get(client.rm.episodes.remote(job.id))
    assert [e["images"] for e in viewer.episodes] == [r["images"] for r in rows]

def test_elo_table_and_outcome_rates_survive_resume(ray_local, tmp_path, ttt_checkpoint):
    """The checkpoint holds the Elo table as of its last eval; a resumed job goes on from it (its games
    add to the saved ones) and every eval row carries OpenTinker's rates for each role and opponent."""
    from otray.actors.job.run import run

    def elo_state(ckpt):
        return json.loads((Path(ckpt) / "state" / "meta.json").read_text())["extra_state"]["data"]["elo"]

    saved = elo_state(ttt_checkpoint)
    assert saved["ratings"]["random"] == 1000.0 and saved["games"]["main"] > 0
    cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml",
                      TINY_GAME + [f"job.output_dir={tmp_path}", "algo.steps=2", "sft.steps=0",
                                   f"checkpoint.resume_from={ttt_checkpoint}"])
    summary = run(cfg, tmp_path / "resumed")
    last = _metrics(tmp_path / "resumed")[-1]
    assert last["step"] == 2 and last["elo/random"] == 1000.0 and "elo/main" in last and "elo/heuristic" in last
    for role in ("player_1", "player_2"):
        for opponent in ("random", "heuristic"):
            rates = [last[f"eval/{role}_vs_{opponent}/{k}_rate"] for k in ("win", "loss", "draw", "timeout", "error")]
            assert sum(rates) == pytest.approx(1.0)
    per_eval = 2 * 2 * 4  # roles x opponents x eval_games, none of them timed out or failed
    assert elo_state(summary["last_checkpoint"])["games"]["main"] == saved["games"]["main"] + per_eval


def test_training_rewards_discount_toward_the_deciding_move_and_charge_each_illegal_reply():
    from otray.actors.job.game_source import training_rewards
    from otray.types import Task, Trajectory

    turns = [Trajectory(task=Task("g", "game"), info={"illegal_replies": n}) for n in (0, 1, 0)]
    assert training_rewards(-1.0, turns, 1.0, 0.0) == [-1.0, -1.0, -1.0]  # today's rule: every decision the outcome
    assert training_rewards(-1.0, turns, 0.5, 0.0) == [-0.25, -0.5, -1.0]  # the last move (the one that lost) most
    assert training_rewards(1.0, turns, 0.5, 0.2) == pytest.approx([0.25, 0.3, 1.0])  # its own illegal reply only
    assert training_rewards(1.0, turns[:1], 0.5, 0.0) == [1.0]  # one trajectory (context: game): the outcome whole
    turns[1].info["move_reward"] = 0.5  # game.move_reward: what the decision's own move earned, on top
    assert training_rewards(-1.0, turns, 1.0, 0.2) == pytest.approx([-1.0, -0.7, -1.0])


def test_move_reward_is_a_function_spec_checked_at_load():
    cfg = config.load(ROOT / "conf" / "gomoku_opentinker.yaml",
                      ["game.move_reward=envs.gomoku:tactics(win_length=3, win=0.5, block=0.25)"])
    from otray.policies import move_reward_function

    shaping = move_reward_function(cfg)  # what the job hands the coordinator
    assert shaping.keywords == {"win_length": 3, "win": 0.5, "block": 0.25}
    assert move_reward_function(config.load(ROOT / "conf" / "gomoku_opentinker.yaml")) is None  # none set
    with pytest.raises(Exception, match="game.move_reward: envs.gomoku:tactics does not take these arguments"):
        move_reward_function(config.load(ROOT / "conf" / "gomoku_opentinker.yaml",
                                         ["game.move_reward=envs.gomoku:tactics(reach=3)"]))
    for bad, says in (("envs.gomoku:tactics(3)", "name=literal"), ("not a function", "module:fn")):
        with pytest.raises(Exception, match=f"game.move_reward: .*{says}"):
            config.load(ROOT / "conf" / "gomoku_opentinker.yaml", [f"game.move_reward={bad}"])


def test_discount_needs_turn_context_and_lies_in_0_1():
    with pytest.raises(Exception, match="context=turn"):
        config.load(ROOT / "conf" / "gomoku_opentinker.yaml", ["game.context=game", "game.discount=0.5"])
    for bad in ("0", "1.5"):
        with pytest.raises(Exception, match="game.discount"):
            config.load(ROOT / "conf" / "gomoku_opentinker.yaml", [f"game.discount={bad}"])
    assert config.load(ROOT / "conf" / "gomoku_opentinker.yaml", ["game.discount=0.5"]).game.discount == 0.5


def test_openings_are_drawn_per_seed_random_or_from_played_games():
    from otray.actors.job.game_source import opening

    drawn = [opening(seed, 4) for seed in range(200)]
    assert set(drawn) == {0, 1, 2, 3, 4}  # random plies: every length, each seed's own
    assert drawn == [opening(seed, 4) for seed in range(200)]  # the same after a resume
    assert {opening(seed, 0, [[1, 2, 3]]) for seed in range(50)} == {0}
    played = [[5, 6, 7, 8, 9, 10, 11], [3, 2], [12, 13, 14]]
    prefixes = [opening(seed, 5, played) for seed in range(300)]
    assert prefixes == [opening(seed, 5, played) for seed in range(300)]
    for p in prefixes:  # the first moves of one game, never the whole game (its deciding move is left to decide)
        assert any(p == g[:len(p)] and len(p) < len(g) for g in played) and len(p) <= 5
    assert {len(p) for p in prefixes} == {0, 1, 2, 3, 4, 5} and [5, 6, 7, 8, 9] in prefixes and [12, 13] in prefixes
    with pytest.raises(Exception, match="game.opening_plies"):
        config.load(ROOT / "conf" / "gomoku_opentinker.yaml", ["game.opening_plies=-1"])
    with pytest.raises(Exception, match="game.openings"):
        config.load(ROOT / "conf" / "gomoku_opentinker.yaml", ["game.openings=book"])
    cfg = config.load(ROOT / "conf" / "gomoku_opentinker.yaml", ["game.opening_plies=4", "game.openings=played"])
    assert (cfg.game.opening_plies, cfg.game.openings) == (4, "played")
