"""Shared fixtures: the tiny model (built once per machine), a local Ray cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from otray.models import resolve_model_path

    return resolve_model_path("tiny", ROOT / ".cache" / "models")


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from otray.models import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
