"""tinker-cookbook 0.6.1's own training loops, unmodified, against ``otray tinker`` on a local Ray.

The cookbook is installed with ``--no-deps`` (``make tinker-cookbook``; it pins ``tml-renderers``,
which only the Inkling/Kimi renderers use). Its recipes take registry model names: the service
maps ``Qwen/Qwen3-8B`` to the tiny model, and the test registers the tiny tokenizer under that
name with the cookbook's ``register_tokenizer``. Everything else (the loop, the renderer, the
checkpoint manager, the rollouts) is the cookbook's code; only the dataset builders are ours.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SERVE_PORT, tinker_service

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")
import chz  # noqa: E402
import tinker  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.types import (  # noqa: E402
    Action, Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult,
)
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"
RENDERER = "role_colon"


@pytest.fixture(scope="module")
def svc(ray_local, tmp_path_factory, tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    register_tokenizer(BASE, lambda: tok)
    keys, stop = tinker_service(ray_local, tmp_path_factory.mktemp("cookbook"), PORT, tiny_path)
    yield keys
    stop()


# --- an arithmetic env in the cookbook's Env interface ------------------------------------------


class SumEnv(Env):
    """One question ``What is a + b?``; reward 1 for the right number, closeness in (0, 0.5] for
    a wrong one, and ``0.1 / (1 + characters)`` for an answer with no number at all.

    The partial credit gives a group of samples different rewards (so non-zero advantages) even
    from an untrained model that never writes a digit, which the test needs to see the adapter move.
    """

    def __init__(self, a: int, b: int, renderer: renderers.Renderer):
        self.a, self.b, self.renderer = a, b, renderer

    async def initial_observation(self):
        convo = [{"role": "user", "content": f"What is {self.a} + {self.b}?"}]
        return self.renderer.build_generation_prompt(convo), self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra=None) -> StepResult:
        message, _ = self.renderer.parse_response(action)
        numbers = re.findall(r"-?\d+", renderers.get_text_content(message))
        guess = int(numbers[-1]) if numbers else None
        answer = self.a + self.b
        if guess is None:
            reward = 0.1 / (1 + len(renderers.get_text_content(message)))
        else:
            reward = 1.0 if guess == answer else 0.5 / (1 + abs(guess - answer))
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences(),
                          metrics={"correct": float(guess == answer)})


class SumGroup(EnvGroupBuilder):
    def __init__(self, make, n: int):
        self.make, self.n = make, n

    async def make_envs(self) -> Sequence[Env]:
        return [self.make() for _ in range(self.n)]


class SumDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batch_size: int, group_size: int, batches: int):
        self.renderer, self.batch_size, self.group_size, self.batches = renderer, batch_size, group_size, batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        rng = np.random.default_rng(index)
        pairs = rng.integers(0, 50, size=(self.batch_size, 2))
        return [SumGroup(partial(SumEnv, int(a), int(b), self.renderer), self.group_size) for a, b in pairs]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class SumDatasetBuilder(RLDatasetBuilder):
    batch_size: int
    group_size: int
    batches: int

    async def __call__(self) -> tuple[RLDataset, None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(BASE))
        return SumDataset(renderer, self.batch_size, self.group_size, self.batches), None


# --- what the cookbook left behind -------------------------------------------------------------


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def final_checkpoint(log_path: Path) -> dict:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    return [r for r in rows if r["name"] == "final"][-1]


def trained_lora_b(store: Path, state_path: str) -> float:
    """The largest |LoRA B| entry in the training state at ``state_path`` (PEFT starts B at zero)."""
    from safetensors.numpy import load_file

    model_id, _, name = state_path.removeprefix("tinker://").split("/")
    safe = model_id.replace(":", "_").replace("/", "_")
    hits = list(store.glob(f"checkpoints/*/{safe}/weights/{name}/adapter_model.safetensors"))
    assert len(hits) == 1, (state_path, hits)
    return max(float(np.abs(v).max()) for k, v in load_file(str(hits[0])).items() if "lora_B" in k)


def rl_config(log: Path, batches: int, **extra) -> rl_train.Config:
    """The cookbook's RL config over :class:`SumDatasetBuilder` (2 groups of 4 a batch) on this service."""
    return rl_train.Config(
        learning_rate=1e-3, dataset_builder=SumDatasetBuilder(batch_size=2, group_size=4, batches=batches),
        model_name=BASE, recipe_name="otray_test_rl", max_tokens=8, log_path=str(log), renderer_name=RENDERER,
        lora_rank=8, eval_every=0, base_url=URL, num_groups_to_log=0, **extra)


def test_cookbook_rl_loop(svc, tmp_path, monkeypatch):
    """``tinker_cookbook.rl.train.main``: 3 sync steps of sample -> reward -> importance_sampling ->
    optim_step -> save for sampler, its final checkpoint saved and readable through the REST client."""
    monkeypatch.setenv("TINKER_API_KEY", svc["alice"])
    log = tmp_path / "rl"
    asyncio.run(rl_train.main(rl_config(log, batches=3, save_every=2)))

    rows = [r for r in metrics(log) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1, 2], rows
    assert all(np.isfinite(r["env/all/reward/total"]) for r in rows)
    final = final_checkpoint(log)
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")
    assert trained_lora_b(svc["store"], final["state_path"]) > 0  # non-zero advantages moved the adapter
    rest = tinker.RestClient(base_url=URL, api_key=svc["alice"])
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    names = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {"weights/final", "sampler_weights/final", "weights/000002"} <= names, names


def test_cookbook_async_rl_loop_with_its_default_loss(svc, tmp_path, monkeypatch, ray_local):
    """The cookbook's async RL (``AsyncConfig``), whose default loss is ``stable_reinforce``: its
    sampling clients record stability info, its datums carry provenance, sampling runs a step ahead
    of training; 3 steps, the adapter moved, the run's checkpoints readable."""
    async_cfg = rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)
    assert async_cfg.loss_fn == "stable_reinforce"  # the default this test is about
    monkeypatch.setenv("TINKER_API_KEY", svc["alice"])
    log = tmp_path / "rl_async"
    cfg = rl_config(log, batches=4, save_every=0, async_config=async_cfg, max_steps=3)
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    service = ray_local.get_actor(NAME, namespace=NAMESPACE)
    before = ray_local.get(service.stability.remote())
    asyncio.run(rl_train.main(cfg))

    used = ray_local.get(service.stability.remote())
    assert used["recorded"] - before["recorded"] >= 3 * 2 * 4  # 3 steps x 2 groups x 4 samples, at least
    assert used["trained"] - before["trained"] >= 3 * 2 * 4 // 2  # stable_reinforce named them (groups may drop)
    rows = [r for r in metrics(log) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows][:3] == [0, 1, 2], rows
    assert all(np.isfinite(r["env/all/reward/total"]) for r in rows)
    final = final_checkpoint(log)
    assert trained_lora_b(svc["store"], final["state_path"]) > 0


def test_cookbook_supervised_loop(svc, tmp_path, monkeypatch, tokenizer):
    """``tinker_cookbook.supervised.train.main`` on a local JSONL chat file: 3 steps of
    forward_backward(cross_entropy) + optim_step with its linear LR schedule, then the final save."""
    monkeypatch.setenv("TINKER_API_KEY", svc["alice"])
    rng = np.random.default_rng(0)
    data = tmp_path / "chats.jsonl"
    with data.open("w") as f:
        for a, b in rng.integers(0, 50, size=(12, 2)):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"{a + b}"}]}) + "\n")
    log = tmp_path / "sl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=BASE, renderer_name=RENDERER,
                                            max_length=64, batch_size=4)
    cfg = sl_train.Config(
        log_path=str(log), model_name=BASE, recipe_name="otray_test_sl", renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(file_path=str(data), common_config=common),
        learning_rate=1e-3, lora_rank=8, base_url=URL, save_every=0, eval_every=0)
    asyncio.run(sl_train.main(cfg))

    rows = [r for r in metrics(log) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == [0, 1, 2], rows
    assert all(0 < r["train_mean_nll"] < 20 for r in rows), rows
    assert rows[2]["train_mean_nll"] < rows[0]["train_mean_nll"], rows  # 6.14 -> 5.74 when written
    final = final_checkpoint(log)
    assert trained_lora_b(svc["store"], final["state_path"]) > 0
