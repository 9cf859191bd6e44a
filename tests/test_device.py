"""model.device / model.dtype resolved in the actor (otray/device.py): what a machine without a GPU gets."""

import pytest
import torch

from otray import config
from otray.device import resolve_device, resolve_dtype
from otray.types import ConfigError

HAS_GPU = torch.cuda.is_available()


def test_auto_picks_the_gpu_when_there_is_one_else_the_cpu():
    assert resolve_device("auto") == ("cuda" if HAS_GPU else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_config_error_naming_the_key(tiny_path):
    from otray.actors.learner.policy_learner import PolicyLearner

    with pytest.raises(ConfigError, match=r"model\.device=cuda but this process sees no GPU.*learner_gpus"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match=r"model\.device=cuda"):
        PolicyLearner(tiny_path, device="cuda")


def test_dtype_auto_is_bf16_on_a_gpu_and_float32_on_the_cpu():
    assert resolve_dtype("auto", "cuda") == "bfloat16" and resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(ConfigError, match="model.dtype='fp8'"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("key, value", [("model.device", "gpu"), ("model.dtype", "half")])
def test_bad_device_or_dtype_in_a_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.load({"envs": {"a": {"entry": "arithmetic", "splits": {"train": {}}}}}, [f"{key}={value}"])


def test_the_cpu_learner_and_sampler_stay_on_the_cpu_in_float32(tiny_path):
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.actors.learner.policy_learner import PolicyLearner

    learner, sampler = PolicyLearner(tiny_path, device="cpu", dtype="auto"), HFBackend(tiny_path, device="cpu", dtype="auto")
    for model in (learner.model, sampler.model):
        p = next(model.parameters())
        assert p.device.type == "cpu" and p.dtype == torch.float32
    assert sampler.packed is not None  # oneDNN-packed sampling stays on for the CPU
