"""Weight sync transports (otray/actors/sampling/transport.py): shared memory delivers the object
store's tensors bit for bit, full and LoRA, into the sampler; auto picks shm on one node only; a
handle that reached another node, or a file that is gone, is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from otray.actors.sampling.transport import SharedFiles, choose, from_shared, to_shared
from otray.types import ConfigError, SharedTensors


def test_any_dtype_and_shape_round_trips_bit_for_bit():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(5, dtype=torch.int64),
               "empty": torch.zeros(0, 4), "odd": torch.randn(1, 3, 3).half()}
    ref = to_shared(tensors, "test-roundtrip")
    try:
        got = from_shared(ref)
        assert list(got) == list(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)
        assert all(offset % 64 == 0 for _, _, _, offset, _ in ref.layout)
    finally:
        Path(ref.path).unlink()


@pytest.mark.parametrize("rank", [0, 4])
def test_shm_gives_the_sampler_the_object_stores_weights(tiny_path, tokenizer, rank):
    """A learner's update sent through shared memory leaves the sampler bit-identical to one sent as tensors."""
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.algos.datums import sft_datum

    learner = PolicyLearner(tiny_path, lora={"rank": rank} if rank else None, seed=0)
    learner.forward_backward([sft_datum(tokenizer.encode("1+2="), tokenizer.encode("3"))] * 2, "cross_entropy")
    learner.optim_step(learning_rate=1e-2)
    by_store, by_shm = RolloutWorker(tiny_path, "hf"), RolloutWorker(tiny_path, "hf")
    by_store.update_weights(learner.weights())
    shared = learner.weights("shm")
    assert isinstance(shared.tensors, SharedTensors) and Path(shared.tensors.path).exists()
    by_shm.update_weights(shared)
    a, b = by_store.backend.model.state_dict(), by_shm.backend.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = learner.weights("shm")  # the same version resent: its file is replaced, not removed
    assert again.tensors.path == shared.tensors.path and Path(again.tensors.path).exists()
    by_shm.update_weights(again)
    for _ in range(3):  # new versions: the learner keeps its latest two files and removes the rest
        learner.version += 1
        learner.weights("shm")
    assert not Path(shared.tensors.path).exists() and len(learner.shared.paths) == 2
    kept = list(learner.shared.paths)
    learner.shared.close()
    assert not any(Path(p).exists() for p in kept)


def test_auto_uses_shared_memory_on_one_node_only():
    assert choose("auto", "n1", ["n1", "n1"]) == "shm"
    assert choose("auto", "n1", ["n1", "n2"]) == "object_store"
    assert choose("auto", None, ["n1"]) == "object_store"
    assert choose("object_store", "n1", ["n1"]) == "object_store" and choose("shm", "n1", ["n2"]) == "shm"
    with pytest.raises(ConfigError, match="rollout.weight_sync='nccl'.*auto, object_store, shm"):
        choose("nccl", "n1", ["n1"])


def test_a_handle_from_another_node_or_a_removed_file_is_a_clear_error(monkeypatch):
    import otray.actors.sampling.transport as transport

    files = SharedFiles()
    ref = files.publish({"w": torch.ones(2)}, "test-node")
    monkeypatch.setattr(transport, "current_node_id", lambda: "other-node")
    with pytest.raises(ConfigError, match="shared memory works on one node.*object_store"):
        from_shared(SharedTensors(ref.path, "learner-node", ref.layout, ref.size))
    files.close()
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="is gone"):
        from_shared(ref)
