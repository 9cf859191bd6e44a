"""League play in real game jobs on a local Ray cluster: the pool grows from the job's checkpoints, the
league worker plays the drawn snapshot with its weights, the pool survives resume, two trained policies
each meet the other's pool."""

import json
from pathlib import Path

import pytest

from otray import config

from tests.conftest import ROOT  # noqa: E402 (the repository root)
from tests.fixtures.jobs import check_smoke_run

# self-play tic-tac-toe, every seed against the league, snapshots only (no fixed opponents in the mix
# once the pool has one): a snapshot every step; a 2-step SFT warm-up moves the weights off the base model
LEAGUE = ["algo.steps=3", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2", "sft.steps=2", "sft.batch_size=4",
          "eval.every=0", "game.policies.player_2=trained", "game.league.every=1", "game.league.share=1.0",
          "game.league.fixed=[random]", "game.league.fixed_share=0.0", "algo.drop_uniform_groups=false",
          "sft.eval_samples=8"]


def _rows(job_dir):
    return [json.loads(line) for line in (Path(job_dir) / "metrics.jsonl").read_text().splitlines()]


def _pool(checkpoint, name="main"):
    data = json.loads((Path(checkpoint) / "state" / "meta.json").read_text())["extra_state"]["data"]
    return data["league"][name]["snapshots"], data["elo"]["ratings"]


@pytest.fixture(scope="module")
def league_job(ray_local, tmp_path_factory):
    from otray.actors.job.run import run

    out = tmp_path_factory.mktemp("league")
    cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml", LEAGUE + [f"job.output_dir={out}"])
    run(cfg, out / "a")
    return out / "a"


def test_the_league_job_passes_the_config_smoke_checks(league_job):
    """conf/tictactoe_vs_random.yaml's smoke run is this job (test_conf_smoke.py: RUN_ELSEWHERE)."""
    cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml", LEAGUE)
    check_smoke_run(cfg, league_job, json.loads((league_job / "summary.json").read_text()), steps=3)


def test_the_pool_grows_from_checkpoints_and_its_snapshots_are_played(league_job):
    rows = {r["step"]: r for r in _rows(league_job) if r["phase"] == "grpo"}
    assert rows[1]["league/pool_size"] == 0 and "league/snapshot_step" not in rows[1]  # before the first snapshot
    assert rows[1]["league/games"] == 2 * 2 * 2  # seeds x seatings (each seat kept once) x rollouts
    assert rows[2]["league/pool_size"] == 1 and rows[2]["league/snapshot_step"] == 1
    assert rows[3]["league/pool_size"] == 2 and rows[3]["league/snapshot_step"] in (1, 2)
    assert rows[3]["league/games_vs_snapshot"] == 8 and 0 <= rows[3]["league/score_vs_snapshot"] <= 1
    for step in (1, 2, 3):  # every step saved a checkpoint for the pool
        assert (league_job / "checkpoints" / f"step-{step:06d}" / "model" / "config.json").exists()
    snapshots, ratings = _pool(league_job / "checkpoints" / "step-000003")
    assert [s["step"] for s in snapshots] == [1, 2, 3]
    assert sum(s["games"] for s in snapshots) == 16  # steps 2 and 3 each played 8 games against one
    assert {"main-step-1", "main-step-2", "main", "random"} <= set(ratings)


def test_a_resumed_job_keeps_its_league(league_job, ray_local, tmp_path):
    from otray.actors.job.run import run

    saved, _ = _pool(league_job / "checkpoints" / "step-000002")
    assert [s["step"] for s in saved] == [1, 2]
    cfg = config.load(ROOT / "conf" / "tictactoe_vs_random.yaml",
                      LEAGUE + [f"job.output_dir={tmp_path}",
                                f"checkpoint.resume_from={league_job / 'checkpoints' / 'step-000002'}"])
    summary = run(cfg, tmp_path / "b")
    row = _rows(tmp_path / "b")[-1]
    assert row["step"] == 3 and row["league/pool_size"] == 2 and row["league/snapshot_step"] in (1, 2)
    resumed, _ = _pool(summary["last_checkpoint"])
    assert [s["step"] for s in resumed] == [1, 2, 3]
    assert [s["games"] for s in resumed[:2]] != [0, 0]  # the record came with it
    assert sum(s["games"] for s in resumed) == sum(s["games"] for s in saved) + 8


def test_snapshot_weights_reach_a_worker(league_job, tiny_path):
    """snapshot_update loads a checkpoint's model into a worker started from the base model: it then
    samples exactly as a worker started from that checkpoint."""
    from otray.actors.job.league import snapshot_update
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.types import SamplingParams

    model_dir = league_job / "checkpoints" / "step-000003" / "model"
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[1, 5, 9, 13, 2], [3, 4, 5]]
    direct = RolloutWorker(str(model_dir), "hf", max_model_len=512, seed=0).generate(prompts, params)
    loaded = RolloutWorker(tiny_path, "hf", max_model_len=512, seed=0)
    base = loaded.generate(prompts, params)
    assert loaded.update_weights(snapshot_update(model_dir, 3)) == 3
    after = loaded.generate(prompts, params)
    def flat(results):
        return [lp for r in results for lp in r.samples[0].logprobs]

    assert [r.samples[0].token_ids for r in after] == [r.samples[0].token_ids for r in direct]
    assert flat(after) == pytest.approx(flat(direct), abs=1e-5)
    assert flat(base) != pytest.approx(flat(direct), abs=1e-5)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        snapshot_update(league_job, 1)


def test_two_trained_policies_each_meet_the_others_pool(ray_local, tmp_path):
    from otray.actors.control.resource_manager import bundles_for
    from otray.actors.job.run import run

    cfg = config.load(ROOT / "conf" / "gomoku_two_policies.yaml",
                      ["algo.steps=2", "algo.batch_size=2", "game.num_rollouts=2", "game.eval_games=2", "eval.every=0",
                       "algo.drop_uniform_groups=false", f"job.output_dir={tmp_path}", "game.league.every=1",
                       "game.league.share=1.0", "game.league.fixed=[random]", "game.league.fixed_share=0.0",
                       "game.kwargs.size=5"])
    assert len(bundles_for(cfg)) == 2 * 2 + 2  # per policy: learner + worker; then one league worker each
    # (conf_smoke's run of this config, RUN_ELSEWHERE): each policy's 2 seeds x 2 rollouts in its seat, and as many
    # of its league games against the other's snapshot
    check_smoke_run(cfg, tmp_path / "two", run(cfg, tmp_path / "two"), steps=2, games=2 * 2 * 2)
    last = _rows(tmp_path / "two")[-1]
    for name in ("black", "white"):
        assert last[f"league/{name}/pool_size"] == 1 and last[f"league/{name}/snapshot_step"] == 1
        assert last[f"league/{name}/games_vs_snapshot"] == 4  # 2 seeds x 2 rollouts: the other one's seat
    snapshots, ratings = _pool(tmp_path / "two" / "checkpoints" / "step-000002", "white")
    assert snapshots[0]["model_dir"].endswith("step-000001/policies/white/model")
    assert {"black-step-1", "white-step-1", "black", "white"} <= set(ratings)
