"""TrainJob on a local Ray cluster with the tiny model: a short job, and bad input."""

import json
from pathlib import Path

import pytest

from otray import config
from otray.types import ConfigError, DatasetError, ModelLoadError


def _cfg(tmp_path, **env_over):
    env = {"entry": "envs.arithmetic:Arithmetic",
           "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": str(tmp_path / "data"), "kwargs": {"num_eval": 40}},
           "splits": {"train": {}, "eval": {"shuffle": False}}, "num_rollouts": 4, "max_tokens_per_turn": 4, **env_over}
    return {"job": {"name": "t", "output_dir": str(tmp_path / "runs")},
            "model": {"cache_dir": str(tmp_path.parent / "models")},
            "rollout": {"backend": "hf", "max_model_len": 64},
            "sft": {"steps": 3, "batch_size": 8, "env": "arithmetic"},
            "algo": {"steps": 2, "batch_size": 4, "drop_uniform_groups": False},
            "eval": {"num_samples": 10},
            "envs": {"arithmetic": env}}


@pytest.fixture(scope="module")
def run_job(ray_local, tiny_path):
    from otray.actors.job.run import run

    def _run(tmp_path, data, overrides=()):
        data["model"]["path"] = tiny_path
        cfg = config.load(data, list(overrides))
        job_dir = tmp_path / "runs" / "t"
        return run(cfg, job_dir), job_dir

    return _run


@pytest.fixture(scope="module")
def default_job(run_job, tmp_path_factory):
    """The default job (3 SFT steps, 2 GRPO steps), run once for the tests that read it."""
    tmp = tmp_path_factory.mktemp("default")
    return run_job(tmp, _cfg(tmp))


def _replay(job_dir):
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r.get("reward_mean"), r.get("eval/accuracy"), r.get("learner/loss"), r.get("learner/num_tokens"))
            for r in rows]


def test_short_job_writes_metrics_and_trajectories(default_job):
    summary, job_dir = default_job
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["base", "sft", "grpo", "grpo"]
    grpo = rows[-1]
    for key in ("reward_mean", "tokens_per_s", "step_s", "learner/grad_norm", "eval/accuracy"):
        assert key in grpo
    assert grpo["learner/step"] == 3 + 2  # sft steps + grpo steps share the optimizer step counter
    # the held-out guard: every eval row has its standard error, RL's the change from the warm-up's score
    p = rows[1]["eval/accuracy"]
    assert rows[1]["eval/accuracy_stderr"] == pytest.approx((p * (1 - p) / 10) ** 0.5)  # 10 eval episodes
    assert grpo["eval/change_from_start"] == pytest.approx(grpo["eval/accuracy"] - rows[1]["eval/accuracy"])
    assert grpo["learner/entropy"] > 0  # the sampled tokens' mean surprise
    assert grpo["learner/grad_clip"] == 1.0  # algo.grad_clip_relative is on by default: its bound is in the rows
    trajs = [json.loads(line) for line in (job_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and trajs[0]["messages"][-1]["role"] == "assistant"
    # drop_uniform_groups is off, so every logged episode was trained on and has an advantage
    assert all(isinstance(t["advantage"], float) for t in trajs)
    assert summary["heldout_end"] is not None


def test_step_breakdown_adds_up_to_the_step_and_rows_reach_wandb(run_job, tmp_path):
    """Every RL row splits its wall time into parts (generate, env, forward_backward, ...) that sum to
    the step's wall time as train.run measured it, within 5%; idle fractions are fractions. The same
    job logs to wandb (offline) and Ray's metrics, as ``logging`` asks, and sends its weights over a
    broadcast group (gloo here), which every row names."""
    from otray.timing import PARTS, breakdown_table

    data = _cfg(tmp_path)
    data["sft"]["steps"] = 0
    data["algo"]["steps"] = 3
    data["logging"] = {"wandb": True, "wandb_mode": "offline", "ray_metrics": True}  # the sinks' time counts too
    data["rollout"]["weight_sync"] = "broadcast"
    _, job_dir = run_job(tmp_path, data)
    runs = list((job_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # the rows reached wandb (offline)
    assert runs and runs[0].stat().st_size > 0
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert len(grpo) == 3
    for r in grpo:
        parts = {k: v for k, v in r.items() if k.startswith("time/") and k.endswith("_s")}
        assert set(parts) <= {f"time/{p}_s" for p in PARTS} and all(v >= 0 for v in parts.values())
        for must in ("generate", "env", "prepare", "forward_backward", "optim_step", "weight_sync"):
            assert parts[f"time/{must}_s"] > 0, must
        assert abs(sum(parts.values()) - r["step_wall_s"]) <= 0.05 * r["step_wall_s"], (parts, r["step_wall_s"])
        assert 0 < r["time/generate_share"] < 1
        assert 0 <= r["time/learner_idle_frac"] < 1 and 0 <= r["time/rollout_idle_frac"] < 1
        assert r["policy_lag"] == 0 and r["weight_sync"] == "broadcast"
    table = breakdown_table(rows).splitlines()
    assert len(table) == 1 + 3 and "forward_backward" in table[0]


def test_one_step_off_policy_trains_on_the_previous_weights_samples_and_resumes(run_job, tmp_path):
    def rows_of(job_dir):
        return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]

    (tmp_path / "a").mkdir()
    a = _cfg(tmp_path / "a")
    a["sft"]["steps"] = 0
    a["algo"].update(steps=4, max_steps_off_policy=1)
    a["checkpoint"] = {"save_every": 2}
    _, a_dir = run_job(tmp_path / "a", a)
    grpo = [r for r in rows_of(a_dir) if r["phase"] == "grpo"]
    assert [r["policy_lag"] for r in grpo] == [0, 1, 1, 1]  # the first batch is sampled before any update
    assert "time/generate_s" in grpo[0]  # later batches were generated while the learner trained:
    assert all("time/generate_s" not in r and "time/rollout_wait_s" in r for r in grpo[1:])  # only the wait shows
    assert len({r["batch"] for r in grpo}) == 4

    (tmp_path / "b").mkdir()
    b = _cfg(tmp_path / "b")
    b["sft"]["steps"] = 0
    b["algo"].update(steps=4, max_steps_off_policy=1)
    b["checkpoint"] = {"resume_from": str(a_dir / "checkpoints" / "step-000002")}
    _, b_dir = run_job(tmp_path / "b", b)
    resumed = [r for r in rows_of(b_dir) if r["phase"] == "grpo"]
    assert [r["batch"] for r in resumed] == [r["batch"] for r in grpo[2:]]  # the prefetched batch is not skipped


def test_colocated_job_generates_in_the_learner(run_job, tmp_path):
    """rollout.colocate: no rollout worker actors, every batch sampled by the current policy (lag 0,
    no weight transfer), and the learner's busy clock covers generation too. The same job runs RL's
    options of issue 55: a linear learning-rate schedule and a KL term to the policy after the warm-up."""
    from otray.actors.control.resource_manager import bundles_for

    data = _cfg(tmp_path)
    data["sft"]["steps"] = 2
    data["algo"].update(steps=3, learning_rate=3e-4, lr_schedule="linear", kl_coeff=0.2)
    data["rollout"]["colocate"] = True
    assert len(bundles_for(config.load(data | {"model": {"path": "tiny"}}))) == 1  # the learner's bundle only
    summary, job_dir = run_job(tmp_path, data)
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert len(grpo) == 3 and [r["policy_lag"] for r in grpo] == [0, 0, 0]
    assert all(r["time/generate_s"] > 0 and r["time/weight_sync_s"] < 0.05 for r in grpo)
    assert all(r["time/learner_idle_frac"] < 0.5 for r in grpo)  # it generates as well as trains
    assert grpo[-1]["learner/step"] == 2 + 3 and "eval/accuracy" in grpo[-1]
    assert summary["heldout_end"] is not None
    assert [r["learner/learning_rate"] for r in grpo] == pytest.approx([3e-4, 2e-4, 1e-4])
    kl = [r["learner/kl_to_start"] for r in grpo]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0  # the first step starts at the reference


def test_env_exceptions_become_error_records_and_the_job_finishes(run_job, tmp_path):
    data = _cfg(tmp_path, entry="tests.fixtures.flaky_envs:SometimesRaises", max_failing_rollouts=4)
    data["algo"]["batch_size"] = 8  # some even answers in every step: a step whose rollouts ALL fail stops
    summary, job_dir = run_job(tmp_path, data)  # the job (tests/actors/control/test_security.py), this one must go on
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("episode_errors", 0) for r in rows) > 0
    trajs = [json.loads(line) for line in (job_dir / "trajectories.jsonl").read_text().splitlines()]
    assert any(t["error"] and "odd answers" in t["error"] for t in trajs)
    assert summary["heldout_end"] is not None


def test_unparseable_output_gets_zero_reward(run_job, tmp_path):
    data = _cfg(tmp_path, entry="tests.fixtures.flaky_envs:Unparseable")
    data["sft"]["steps"] = 0
    data["algo"]["steps"] = 1
    _, job_dir = run_job(tmp_path, data)
    trajs = [json.loads(line) for line in (job_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(t["reward"] == 0.0 for t in trajs)


def test_empty_dataset_and_missing_model_are_clear_errors(run_job, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    data = _cfg(tmp_path, splits={"train": {"path": str(empty)}})
    with pytest.raises(DatasetError, match="empty"):
        run_job(tmp_path, data)
    from otray.actors.job.run import run

    bad = _cfg(tmp_path)
    bad["model"]["path"] = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        run(config.load(bad), tmp_path / "x")
    with pytest.raises(ConfigError, match="sft.env"):
        config.load({**_cfg(tmp_path), "sft": {"steps": 1, "env": "nope"}})


def test_same_seed_same_run(run_job, default_job, tmp_path):
    """The default job again, in another directory: the same rewards, accuracy, losses and tokens."""
    _, job_dir = run_job(tmp_path, _cfg(tmp_path))
    first = _replay(default_job[1])
    assert first == _replay(job_dir)
    assert all(tokens > 0 for *_, tokens in first[2:])  # both GRPO steps trained on sampled tokens


def test_resume_continues_step_counter_and_data_and_samples_exactly_the_same(run_job, tmp_path):
    def rows_of(job_dir):
        return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]

    (tmp_path / "a").mkdir()
    a = _cfg(tmp_path / "a")
    a["algo"]["steps"] = 4
    a["checkpoint"] = {"save_every": 2}
    summary, a_dir = run_job(tmp_path / "a", a)
    assert summary["last_checkpoint"].endswith("step-000004")
    ck = a_dir / "checkpoints" / "step-000002"
    assert (ck / "state" / "meta.json").exists() and (ck / "model" / "config.json").exists()

    (tmp_path / "b").mkdir()
    b = _cfg(tmp_path / "b")
    b["algo"]["steps"] = 4
    b["checkpoint"] = {"resume_from": str(ck)}
    b_summary, b_dir = run_job(tmp_path / "b", b)
    # resumed into another directory, the job keeps the row RL started from (carried by the checkpoint): its
    # summary, the held-out guard and each eval's change from the start go on from the warm-up's score
    warmed = next(r for r in rows_of(a_dir) if r["phase"] == "sft")
    assert [r for r in rows_of(b_dir) if r["phase"] in ("sft", "init")] == [warmed]
    assert b_summary["heldout_start"] == warmed["eval/accuracy"]
    end = rows_of(b_dir)[-1]
    assert end["eval/change_from_start"] == pytest.approx(end["eval/accuracy"] - warmed["eval/accuracy"])
    uninterrupted = {r["step"]: r for r in rows_of(a_dir) if r["phase"] == "grpo"}
    resumed = [r for r in rows_of(b_dir) if r["phase"] == "grpo"]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:  # exactly the same steps: the workers' RNG states are in the checkpoint too
        same = uninterrupted[r["step"]]
        assert r["batch"] == same["batch"] and r["learner/step"] == same["learner/step"]
        assert all(r[k] == same[k] for k in ("reward_mean", "learner/loss", "rollout/logprob_kl")), (r, same)
    assert uninterrupted[3]["batch"] != uninterrupted[4]["batch"]


def test_relative_grad_clip_follows_the_recent_rl_steps_norms_and_is_saved(run_job, tmp_path):
    """``algo.grad_clip_relative``: from the 4th RL step on, each step is clipped to k times the median norm of the
    steps before it (not the SFT warm-up's); the norms travel in the checkpoint, so a resumed job clips alike."""
    from otray.algos.clipping import MIN_SEEN

    data = _cfg(tmp_path)
    data["algo"].update(steps=MIN_SEEN + 1, grad_clip_relative=0.5)
    data["checkpoint"] = {"save_every": MIN_SEEN + 1}
    _, job_dir = run_job(tmp_path, data)
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "grpo"]
    norms = [r["learner/grad_norm"] for r in rl]
    assert [r["learner/grad_clip"] for r in rl[:MIN_SEEN]] == [1.0] * MIN_SEEN
    median = sorted(norms[:MIN_SEEN])[MIN_SEEN // 2]
    assert rl[MIN_SEEN]["learner/grad_clip"] == pytest.approx(min(1.0, 0.5 * median)) and 0.5 * median < 1.0
    meta = json.loads((job_dir / "checkpoints" / f"step-{MIN_SEEN + 1:06d}" / "state" / "meta.json").read_text())
    assert meta["extra_state"]["grad_norms"] == pytest.approx(norms)


def test_resume_from_a_missing_checkpoint_is_a_clear_error(run_job, tmp_path):
    data = _cfg(tmp_path)
    data["checkpoint"] = {"resume_from": str(tmp_path / "nope")}
    with pytest.raises(ModelLoadError, match="holds no learner state"):
        run_job(tmp_path, data)


def test_actors_are_named_after_the_job_and_end_with_it(ray_local, tiny_path, tmp_path):
    """Every actor of a job shows in the Ray dashboard's actor list as ``otray:<job id>:<role>``; the
    job's end (``TrainJob.close``, which ``run`` calls) kills them, so a job run in-process leaves none."""
    import time

    from otray.actors.job.train_job import TrainJob

    data = _cfg(tmp_path)
    data["model"]["path"] = tiny_path
    data["rollout"]["num_workers"] = 2
    job = TrainJob(config.load(data), tmp_path / "runs" / "job-42")

    def names():
        return {a["name"] for a in ray_local.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("otray:job-42:")}

    try:
        assert names() == {"otray:job-42:learner", "otray:job-42:rollout-0", "otray:job-42:rollout-1"}
    finally:
        job.close()
    deadline = time.time() + 30
    while names() and time.time() < deadline:
        time.sleep(0.2)
    assert not names()


def test_a_job_that_heals_checkpoints_its_warm_up_and_resumes_it_midway_exactly(ray_local, tiny_path, tmp_path):
    """With checkpoints and job.max_failures, the SFT warm-up is checkpointed at each accuracy check (its
    progress in the checkpoint's state); a job resumed from one midway finishes the warm-up and the RL steps
    exactly as the uninterrupted job did."""
    import shutil

    from otray.actors.job.run import run

    def rows_of(job_dir):
        return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]

    midway = tmp_path / "midway"

    def keep_first_midway(step: int, path: str) -> None:
        meta = json.loads((Path(path) / "state" / "meta.json").read_text())
        if "sft_warmup" in meta["extra_state"] and not midway.exists():
            shutil.copytree(path, midway)

    data = _cfg(tmp_path)
    data["model"]["path"] = tiny_path
    data["sft"].update(steps=12, check_every=4, stop_at_accuracy=1.0, check_samples=8)
    data["checkpoint"] = {"save_every": 1}
    run(config.load(data), tmp_path / "a", on_checkpoint=keep_first_midway)
    assert json.loads((midway / "state" / "meta.json").read_text())["extra_state"]["sft_warmup"]["steps"] == 4
    data["checkpoint"] = {"save_every": 1, "resume_from": str(midway)}
    run(config.load(data), tmp_path / "b")
    a, b = rows_of(tmp_path / "a"), rows_of(tmp_path / "b")
    sft_a, sft_b = ([r for r in rows if r["phase"] == "sft"] for rows in (a, b))
    assert len(sft_b) == 1 and sft_b[0]["sft_steps"] == sft_a[0]["sft_steps"] == 12
    assert sft_b[0]["sft_loss"] == sft_a[0]["sft_loss"] and sft_b[0]["eval/accuracy"] == sft_a[0]["eval/accuracy"]
    grpo_a, grpo_b = ([(r["step"], r["reward_mean"], r["learner/loss"]) for r in rows if r["phase"] == "grpo"]
                      for rows in (a, b))
    assert grpo_b == grpo_a and len(grpo_a) == 2


def test_a_dead_rollout_worker_is_replaced_in_its_bundle_up_to_max_failures(ray_local, tiny_path, tmp_path):
    """A rollout worker killed between steps is replaced before the next step by a new actor in its bundle,
    given the current weights, and samples its share from then on (no restart of the job); a generate call
    that lost every worker gets them replaced and goes on; past ``job.max_failures`` replacements the
    others sample a dead one's share."""
    import time

    from otray import metric_keys as K
    from otray.actors.job.train_job import TrainJob
    from otray.types import SamplingParams

    data = _cfg(tmp_path)
    data["model"]["path"] = tiny_path
    data["rollout"]["num_workers"] = 2
    data["job"]["max_failures"] = 2
    lines: list[str] = []
    job = TrainJob(config.load(data), tmp_path / "runs" / "heal", log=lines.append)

    def kill(worker) -> None:  # and wait until it is gone (ray.kill returns at once)
        ray_local.kill(worker)
        with pytest.raises(ray_local.exceptions.RayActorError):
            for _ in range(100):
                ray_local.get(worker.ping.remote(), timeout=10)
                time.sleep(0.1)

    try:
        fleet = job.main.fleet
        assert K.WORKERS_REPLACED not in job.rl_step()
        first = fleet.workers[1]
        kill(first)
        row = job.rl_step()
        assert row.get(K.WORKERS_REPLACED) == 1 and fleet.live == [0, 1] and fleet.workers[1] is not first, lines
        assert any("rollout worker 1 replaced" in line for line in lines), lines
        assert row[K.RECOVERY_WORKERS].startswith("policy 'main': rollout worker 1 replaced in its bundle (") \
            and "Error: " in row[K.RECOVERY_WORKERS], row
        assert ray_local.get(fleet.workers[1].policy_version.remote()) == job.main.version  # the weights it was given
        assert ray_local.get(fleet.workers[1].busy_s.remote()) > 0  # it sampled its share of the step
        # what worker 0 would draw next, from its RNG state after its last share (kept by the fleet)
        params, dead = SamplingParams(max_tokens=8, ignore_eos=True), fleet.workers[0]
        would = [[s.token_ids for s in r.samples] for r in ray_local.get(dead.generate.remote([[1, 2, 3]] * 4, params))]
        ray_local.get(dead.set_rng_state.remote(fleet.rng[0]))  # back to that state
        kill(fleet.workers[0]), kill(fleet.workers[1])  # every worker lost under a generate call
        out = fleet.generate([[1, 2, 3]] * 4, params)
        assert len(out) == 4 and fleet.live == [0], fleet.dead  # one replaced (the limit), then sampled all
        # drawn from the dead worker's state, not a fresh one (the lost shares [0, 2] and [1, 3], in that order)
        assert [[s.token_ids for s in out[j].samples] for j in (0, 2, 1, 3)] == would
        row = job.rl_step()
        assert row[K.WORKERS_REPLACED] == 2 and fleet.live == [0] and "rollout worker 0 replaced" in row[K.RECOVERY_WORKERS]
        assert any("rollout worker 1 not replaced (2 replaced already" in line for line in lines), lines
    finally:
        job.close()
