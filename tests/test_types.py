import pickle

import pytest
import torch

from otray import types as T


def _examples():
    task = T.Task(id="t1", env="arithmetic", data={"question": "1+2=", "answer": 3})
    traj = T.Trajectory(task=task, prompt_len=2, agent_id="player_0", error=T.ErrorRecord("env_exception", "boom", 1))
    traj.append([1, 2], sampled=False)
    traj.append([3], sampled=True, logprobs=[-0.5])
    return [
        T.SamplingParams(max_tokens=4, temperature=0.7, stop_token_ids=(2,)),
        T.Sample([1, 2], [-0.1, -0.2], T.FinishReason.STOP),
        T.GenerateResult([T.Sample([1], [-0.1], T.FinishReason.LENGTH)], policy_version=3),
        T.WeightUpdate(2, "full", {"w": torch.ones(2, 2)}),
        T.WeightUpdate(2, "lora", {"a": torch.zeros(1)}, {"r": 8}),
        T.WeightUpdate(3, "full", T.SharedTensors("/dev/shm/otray-weights-1-v3.bin", "node",
                                                  (("w", "float32", (2, 2), 0, 16),), 64)),
        T.SharedTensors("/dev/shm/otray-weights-1-v4.bin", None, (), 0),
        T.WeightUpdate(5, "full", T.DeviceTensors("cuda_ipc", (("w", "bfloat16", (2, 2), 0, 8),), 256, "node",
                                                  "cuda:GPU-1", 1, b"handle"), None,
                       T.WeightChecksum(("w",), (1.5,))),
        T.DeviceTensors("broadcast", (), 1, None, "cpu", 2),
        T.WeightChecksum((), ()),
        task,
        T.ErrorRecord("prompt_too_long", "too long", 0),
        traj,
        T.TrajectoryGroup(task, [traj, traj]),
        T.TrajectoryGroup(task, [traj], key=(7, 0, "player_1"), max_failing=1),
        T.WorkerInfo("hf", 512, (2,), 3, "node"),
        T.LearnerInfo(4, 4, 0, "node"),
        T.LossNormalizer(12.0, 3.0),
        T.Datum([1, 2], [2, 3], [0.0, 1.0], [0.0, 0.5], [0.0, -0.3], [0.0, 1.0]),
    ]


@pytest.mark.parametrize("value", _examples(), ids=lambda v: type(v).__name__)
def test_pickle_round_trip(value):
    back = pickle.loads(pickle.dumps(value))
    if isinstance(value, T.WeightUpdate):
        assert back.version == value.version and back.kind == value.kind and back.lora_config == value.lora_config
        assert back.checksum == value.checksum
        if isinstance(value.tensors, (T.SharedTensors, T.DeviceTensors)):
            assert back.tensors == value.tensors
        else:
            assert all(torch.equal(back.tensors[k], value.tensors[k]) for k in value.tensors)
    else:
        assert back == value


def test_every_public_type_is_covered():
    import dataclasses

    covered = {type(v) for v in _examples()}
    declared = {obj for obj in vars(T).values() if dataclasses.is_dataclass(obj) and obj.__module__ == T.__name__}
    assert declared <= covered, f"add a round-trip example for {declared - covered}"


def test_trajectory_append_keeps_fields_aligned():
    traj = T.Trajectory(task=T.Task("x", "e"))
    traj.append([5, 6, 7], sampled=False)
    traj.append([8, 9], sampled=True, logprobs=[-1.0, -2.0])
    assert traj.loss_mask == [0, 0, 0, 1, 1]
    assert traj.logprobs == [0.0, 0.0, 0.0, -1.0, -2.0]
    assert traj.num_sampled == 2
    with pytest.raises(ValueError):
        traj.append([1], sampled=True)


def test_datum_rejects_unequal_lengths():
    with pytest.raises(ValueError, match="equal length"):
        T.Datum([1, 2], [2], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0])


def test_errors_inherit_builtins():
    assert issubclass(T.ConfigError, ValueError) and issubclass(T.ConfigError, T.OtrayError)
    assert issubclass(T.ModelLoadError, FileNotFoundError)
    with pytest.raises(T.ConfigError):
        T.SamplingParams(max_tokens=0)
