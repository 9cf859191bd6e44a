"""tinker-cookbook's recipes, unmodified, run as their READMEs say (``python -m tinker_cookbook.recipes....``) in
a subprocess against ``otray tinker`` on the tiny models:

- ``vlm_classifier`` (supervised, images) on the tiny Qwen2-VL offered as ``Qwen/Qwen3-VL-30B-A3B-Instruct``;
- ``multiplayer_rl/text_arena`` (self-play RL on TextArena's TicTacToe, evaluated against the base model) on
  the tiny text model offered as ``Qwen/Qwen3-8B``.

What the recipes would download is put where Hugging Face's own offline loading finds it:
- each model's tokenizer and image processor: the tiny models' files in a Hugging Face hub cache under
  the names the service offers them as, read with ``HF_HUB_OFFLINE=1``;
- the classifier's dataset, ``dpdl-benchmark/caltech101``: a local folder of that name in the working
  directory (which ``datasets.load_dataset`` reads before the hub) holding train/test Parquet files of
  pictures of 1-4 shapes labelled by their count (a ``ClassLabel``, as Caltech101's labels are).
Everything else -- renderers (image chunks with the image processor's token count), the training loops,
the evaluators, TextArena's games, the checkpoints -- is the cookbook's and TextArena's code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envs.shapes import draw, scene
from tests.conftest import SERVE_PORT, tinker_service

pytest.importorskip("tinker_cookbook")
datasets = pytest.importorskip("datasets")

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
VL, TEXT = "Qwen/Qwen3-VL-30B-A3B-Instruct", "Qwen/Qwen3-8B"
CLASSES = ["one", "two", "three", "four"]


@pytest.fixture(scope="module")
def svc(ray_local, tmp_path_factory, tiny_path, vl_path):
    models = [{"name": VL, "path": vl_path, "sampler": {"engine": "learner"}},
              # TextArena's prompts are ~800 of the tiny tokenizer's tokens (its rotary positions go past 512)
              {"name": TEXT, "path": tiny_path, "max_context_length": 2048, "sampler": {"engine": "learner"}}]
    keys, stop = tinker_service(ray_local, tmp_path_factory.mktemp("cookbook_recipes"), PORT, tiny_path, models=models)
    hub = tmp_path_factory.mktemp("hub")
    for name, path in ((VL, vl_path), (TEXT, tiny_path)):
        hub_snapshot(hub, name, path)
    yield {**keys, "hub": hub}
    stop()


def hub_snapshot(root: Path, name: str, model_dir: str) -> None:
    """``model_dir``'s files as the snapshot of ``name`` in the Hugging Face hub cache at ``root`` (what a
    download leaves: ``models--ORG--NAME/snapshots/<commit>/`` and ``refs/main`` naming the commit)."""
    repo = root / ("models--" + name.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def recipe(module: str, args: list[str], svc: dict, cwd: Path) -> None:
    """``python -m <module> <args>`` against this service (the SDK reads TINKER_BASE_URL and TINKER_API_KEY),
    offline: models from the hub cache, datasets from ``cwd``."""
    env = {**os.environ, "TINKER_BASE_URL": URL, "TINKER_API_KEY": svc["alice"], "HF_HUB_CACHE": str(svc["hub"]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cwd / "datasets"),
           "WANDB_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", module, *args, "behavior_if_log_dir_exists=delete"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def shapes_dataset(folder: Path, sizes: dict[str, int]) -> None:
    """Caltech101's layout for the recipe: per split a Parquet file of ``image`` (an Image feature) and
    ``label`` (a ClassLabel): pictures of 1-4 shapes labelled by how many there are."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    folder.mkdir(parents=True)
    for k, (split, n) in enumerate(sizes.items()):
        rows = [scene(1000 * k + i) for i in range(n)]
        data = {"image": [{"bytes": draw(shapes).data, "path": None} for _, shapes in rows],
                "label": [count - 1 for count, _ in rows]}
        datasets.Dataset.from_dict(data, features=features).to_parquet(str(folder / f"{split}.parquet"))


def test_vlm_classifier_recipe_runs_unmodified(svc, tmp_path):
    """The recipe's supervised loop on image chunks its renderer makes (the image processor's token count
    checked by the service), its NLL evaluator on the test split and its sampling evaluator (image prompts
    sampled by the service, answers parsed). The tiny model at random init learns the answer's wording
    (5e-3 decaying linearly: the last two epochs' median batch NLL and the final test NLL fall from 6.16 to
    ~1.7; a constant 1e-2 levelled off near half and let single batches spike, 9.1 once in a CI run), not
    yet the counts (accuracy stays near 0)."""
    shapes_dataset(tmp_path / "dpdl-benchmark" / "caltech101", {"train": 64, "test": 16})
    recipe("tinker_cookbook.recipes.vlm_classifier.train",
           [f"experiment_dir={tmp_path / 'runs'}", f"base_url={URL}", f"model_name={VL}",
            "renderer_name=qwen3_vl_instruct", "lora_rank=16", "learning_rate=5e-3", "lr_schedule=linear",
            "num_epochs=6", "batch_size=16", "eval_every=23", "save_every=20", "n_eval=16", "max_tokens=8"],
           svc, tmp_path)
    (run,) = (tmp_path / "runs").iterdir()
    rows = metrics(run)
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 24, nll  # 64 pictures x 6 epochs / 16 a batch
    assert sorted(nll[-8:])[3] < 0.5 * nll[0], nll  # the last two epochs' (lower) median batch
    evals = [(r["step"], r["accuracy"], r["test/nll"]) for r in rows if "accuracy" in r]
    assert [s for s, _, _ in evals] == [0, 23] and evals[-1][2] < 0.5 * evals[0][2], evals
    assert all(0.0 <= a <= 1.0 for _, a, _ in evals)
    checkpoints = [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    assert checkpoints[-1]["sampler_path"].startswith("tinker://"), checkpoints


def test_text_arena_self_play_recipe_runs_unmodified(svc, tmp_path):
    """The cookbook's only self-play recipe: both seats of TextArena's TicTacToe sampled from the training
    client's weights through one coordinator per game, evaluated against the base model (a second sampling
    client); the tiny model's moves are mostly illegal (TextArena's -2), which is what it learns from."""
    log = tmp_path / "text_arena"
    recipe("tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
           [f"model_name={TEXT}", "renderer_name=qwen3_disable_thinking", "batch_size=4", "num_train_datapoints=8",
            "num_test_datapoints=4", "max_tokens=12", "eval_every=1", "save_every=2", "learning_rate=1e-3",
            f"log_path={log}"], svc, tmp_path)
    rows = metrics(log)
    steps = [r for r in rows if "progress/batch" in r]
    assert [r["progress/batch"] for r in steps] == [0, 1], rows
    assert all(-2.0 <= r["env/all/reward/total"] <= 1.0 and "optim/entropy" in r for r in steps), steps
    assert sum("test/env/all/reward/total" in r for r in rows) >= 2  # evals against the base model, start and end
    assert (log / "checkpoints.jsonl").exists()
