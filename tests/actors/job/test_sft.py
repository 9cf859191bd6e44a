"""SFT jobs (``job.kind: sft``): chat datums (pure), then whole jobs on a local Ray cluster."""

import json
from pathlib import Path

import pytest
import yaml

from otray import config
from otray.algos.datums import chat_datum
from otray.types import ConfigError, DatasetError


def _trained_text(tokenizer, datum):
    return [tokenizer.decode([t]) for t, m in zip(datum.target_ids, datum.mask) if m]


def test_chat_datum_trains_on_assistant_turns_only(tokenizer):
    msgs = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"}]
    d = chat_datum(tokenizer, msgs)
    assert len(d.input_ids) == len(d.target_ids) == len(d.mask) == len(d.weights)
    assert d.input_ids[1:] == d.target_ids[:-1]
    # exactly each reply and its end-of-turn token; not the template's newline after it
    assert "".join(_trained_text(tokenizer, d)) == "3<|im_end|>4<|im_end|>"
    # the sequence is the template's rendering of the whole conversation
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tokenizer.decode([d.input_ids[0], *d.target_ids]) == full


@pytest.mark.parametrize("msgs, match", [
    ([{"role": "user", "content": "hi"}], "at least one 'assistant'"),
    ([], "at least one 'assistant'"),
    ([{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}], "message 0 must be an object"),
])
def test_chat_datum_rejects_bad_rows(tokenizer, msgs, match):
    with pytest.raises(DatasetError, match=match):
        chat_datum(tokenizer, msgs)


def _sft_cfg(tmp_path, *, with_env=True, steps=40):
    data = {"job": {"name": "sft", "kind": "sft", "output_dir": str(tmp_path / "runs")},
            "model": {"cache_dir": str(tmp_path.parent / "models")},
            "rollout": {"backend": "hf", "max_model_len": 64},
            "sft": {"steps": steps, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 10, "eval_samples": 64,
                    "dataset": {"builder": "envs.arithmetic:make_chat_dataset", "dir": str(tmp_path / "chat"),
                                "kwargs": {"num_eval": 64}},
                    "splits": {"train": {}, "eval": {"shuffle": False}}},
            "eval": {"every": 20, "num_samples": 16}}
    if with_env:
        data["envs"] = {"arithmetic": {
            "entry": "envs.arithmetic:Arithmetic", "max_tokens_per_turn": 4,
            "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": str(tmp_path / "data"),
                        "kwargs": {"num_eval": 64}},
            "splits": {"train": {}, "eval": {"shuffle": False}}}}
    return data


def test_sft_config_checks(tmp_path):
    from otray.actors.control.resource_manager import bundles_for

    data = _sft_cfg(tmp_path, with_env=False)
    cfg = config.load(data)
    assert len(bundles_for(cfg)) == 1  # no envs to evaluate: no rollout workers
    assert len(bundles_for(config.load(_sft_cfg(tmp_path)))) == 2
    del data["sft"]["splits"]
    with pytest.raises(ConfigError, match="sft.splits.train"):
        config.load(data)
    with pytest.raises(ConfigError, match="sft.steps >= 1"):
        config.load(_sft_cfg(tmp_path), ["sft.steps=0"])


@pytest.fixture(scope="module")
def run_job(ray_local, tiny_path):
    from otray.actors.job.run import run

    def _run(tmp_path, data, name="sft"):
        data["model"]["path"] = tiny_path
        job_dir = tmp_path / "runs" / name
        return run(config.load(data), job_dir), job_dir

    return _run


def _rows(job_dir):
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_job_lowers_heldout_loss_and_evaluates_envs(run_job, tmp_path):
    summary, job_dir = run_job(tmp_path, _sft_cfg(tmp_path))
    rows = _rows(job_dir)
    assert [r["phase"] for r in rows] == ["init"] + ["sft"] * 40
    assert [r["step"] for r in rows[1:]] == list(range(1, 41))
    evals = [r for r in rows if "eval/sft_loss" in r]
    assert [r["step"] for r in evals] == [0, 20, 40]
    # the held-out chat loss falls well below where the random model starts
    assert evals[-1]["eval/sft_loss"] < 0.6 * evals[0]["eval/sft_loss"]
    assert all("eval/arithmetic/accuracy" in r for r in evals)  # envs evaluated with synced weights
    assert rows[-1]["learner/step"] == 40
    assert (job_dir / "checkpoints" / "step-000040" / "model" / "config.json").exists()
    assert summary["heldout_end"] is not None and summary["backend"] == "hf"


def test_sft_job_without_envs_resumes_at_the_same_batch(run_job, tmp_path):
    data = _sft_cfg(tmp_path, with_env=False, steps=4)
    data["checkpoint"] = {"save_every": 2}
    summary, a_dir = run_job(tmp_path, data, "a")
    assert summary["backend"] is None  # no rollout workers were started
    b = _sft_cfg(tmp_path, with_env=False, steps=4)
    b["checkpoint"] = {"resume_from": str(a_dir / "checkpoints" / "step-000002")}
    _, b_dir = run_job(tmp_path, b, "b")
    first, resumed = _rows(a_dir), [r for r in _rows(b_dir) if r["phase"] == "sft"]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["batch"] for r in resumed] == [r["batch"] for r in first if r["step"] in (3, 4)]
    # same weights, same data, same optimizer state: the same losses
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in first if r["step"] in (3, 4)], rel=1e-4)


def test_sft_row_without_messages_is_a_clear_error(run_job, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "r1", "prompt": "1+1=", "answer": "2"}) + "\n")
    data = _sft_cfg(tmp_path, with_env=False, steps=1)
    data["sft"]["dataset"] = {}
    data["sft"]["splits"] = {"train": {"path": str(bad)}}
    with pytest.raises(DatasetError, match="SFT row 'r1' has no 'messages' field"):
        run_job(tmp_path, data, "bad")


def test_sft_job_of_a_game_config_trains_on_its_chat_data_only(run_job, tmp_path):
    """``job.kind=sft`` on a game config (e.g. an imitation check on Gomoku's teacher data): the SFT on the
    game's chat data and a checkpoint; no games are played (no rollout workers), so no game rows."""
    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "conf" / "gomoku_opentinker.yaml").read_text())
    data["job"].update(kind="sft", output_dir=str(tmp_path / "runs"))
    data["model"]["cache_dir"] = str(tmp_path.parent / "models")
    data["sft"].update(steps=2, warmup_steps=1)
    kwargs = {"size": 4, "win_length": 3, "num_train": 64, "num_eval": 8, "teacher": "tactics"}
    data["sft"]["dataset"].update(dir=str(tmp_path / "chat"), kwargs=kwargs)
    summary, job_dir = run_job(tmp_path, data, "game_sft")
    rows = _rows(job_dir)
    assert [r["phase"] for r in rows] == ["init", "sft", "sft"] and summary["backend"] is None
    assert "eval/sft_loss" in rows[-1] and not any(k.startswith("eval/black") for r in rows for k in r)
    assert (job_dir / "checkpoints" / "step-000002" / "model" / "config.json").exists()
