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
    assert not Path(shared.tensors.path).exists() and len(learner.publisher.shared.paths) == 2
    kept = list(learner.publisher.shared.paths)
    learner.publisher.shared.close()
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


def test_a_starting_learner_sweeps_the_shared_files_of_dead_learners(monkeypatch, tmp_path):
    """Shared memory is RAM: files left by learners that were killed (named by their process id) are removed
    when a learner starts its files; a live process's and other files stay. (Before this, the test suite
    left 2,070 files, 7.7 GB, in /dev/shm of this machine.)"""
    import os
    import subprocess

    import otray.actors.sampling.transport as transport

    monkeypatch.setattr(transport, "SHM_DIR", tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"otray-weights-{dead.pid}-v3.bin", f"otray-weights-{dead.pid}-v4.partial", "otray-weights-1-v2.bin",
             f"otray-weights-{os.getpid()}-v1.bin", "otray-weights-test-node.bin"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    files = SharedFiles()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    ref = files.publish({"w": torch.ones(2)}, f"{os.getpid()}-v2")
    files.close()
    assert not Path(ref.path).exists()


def test_auto_takes_cuda_ipc_when_every_worker_shares_the_learners_gpu():
    gpu, other = "cuda:GPU-aaaa", "cuda:GPU-bbbb"
    assert choose("auto", "n1", ["n1", "n1"], gpu, [gpu, gpu]) == "cuda_ipc"
    assert choose("auto", "n1", ["n1"], gpu, [other]) == "shm"
    assert choose("auto", "n1", ["n2"], gpu, [gpu]) == "object_store"
    assert choose("auto", "n1", ["n1"], "cpu", ["cpu"]) == "shm"
    assert choose("broadcast", "n1", ["n2"]) == "broadcast"


def test_cuda_ipc_on_a_cpu_learner_is_refused_by_name(tiny_path):
    from otray.actors.learner.policy_learner import PolicyLearner

    with pytest.raises(ConfigError, match="cuda_ipc needs the learner on a GPU.*shm or auto"):
        PolicyLearner(tiny_path).weights("cuda_ipc")


@pytest.mark.parametrize("rank", [0, 4])
def test_broadcast_over_gloo_gives_every_worker_the_object_stores_weights(ray_local, tiny_path, tokenizer, rank):
    """Two workers in the learner's broadcast group (gloo here, NCCL on GPUs) end bit-identical to a worker
    updated through the object store, in the workers' dtype, for full and LoRA updates."""
    import ray

    from otray.actors.job.runtime import open_broadcast
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.fleet import RolloutFleet
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.algos.datums import sft_datum

    learner = ray.remote(num_cpus=0)(PolicyLearner).remote(tiny_path, lora={"rank": rank} if rank else None)
    workers = [ray.remote(num_cpus=0)(RolloutWorker).remote(tiny_path, "hf", dtype="bfloat16") for _ in range(3)]
    try:
        open_broadcast(learner, workers[:2])
        for step in range(1, 3):
            learner.forward_backward.remote([sft_datum(tokenizer.encode("1+2="), tokenizer.encode("3"))], "cross_entropy")
            learner.optim_step.remote(learning_rate=1e-2)
            update = learner.weights.remote("broadcast", "bfloat16")
            assert RolloutFleet(workers[:2]).update_weights(update, step, learner.send_weights.remote()) == [step, step]
        assert ray.get(workers[2].update_weights.remote(learner.weights.remote("object_store", "bfloat16"))) == 2
        kind = "lora" if rank else "full"

        def held(w):
            return ray.get(w.__ray_call__.remote(sampler_state, kind))

        want = held(workers[2])
        for w in workers[:2]:
            got = held(w)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            if kind == "full":  # (an adapter travels in its own dtype: PEFT keeps it in float32)
                assert all(v.dtype == torch.bfloat16 for v in got.values() if v.is_floating_point())
    finally:
        for a in (learner, *workers):
            ray.kill(a)


def sampler_state(worker, kind):
    """(Run inside a RolloutWorker actor) the weights its sampler holds: the model's, or the adapter's."""
    from peft import get_peft_model_state_dict

    model = worker.backend.model
    return model.state_dict() if kind == "full" else get_peft_model_state_dict(model)


def test_a_corrupted_or_skipped_update_is_caught_naming_the_worker(ray_local, tiny_path):
    """The checksum sent with an update is checked against the update as it arrived and against the
    worker's weights after loading (in the worker's dtype: float32 sent to a bf16 sampler is no fault); a
    worker that reports another version than the update's fails the fleet's sync."""
    import dataclasses

    import ray

    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.fleet import RolloutFleet
    from otray.actors.sampling.device_transport import checksum
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.types import WeightSyncError

    update = PolicyLearner(tiny_path).weights()
    name = update.checksum.names[-1]
    corrupted = dataclasses.replace(update, tensors={**update.tensors, name: update.tensors[name] + 1e-3})
    worker = RolloutWorker(tiny_path, "hf")
    with pytest.raises(WeightSyncError, match=f"loaded version 0 but its '{name}' differs from the learner's .*"
                                              "corrupted on its way"):
        worker.update_weights(corrupted)
    bf16 = RolloutWorker(tiny_path, "hf", dtype="bfloat16")  # the learner's float32, held rounded: accepted
    assert bf16.update_weights(update) == 0
    assert next(bf16.backend.model.parameters()).dtype == torch.bfloat16
    worker.backend.load_full_weights = lambda tensors: None  # a loader that silently does nothing
    moved = dataclasses.replace(update, tensors={k: v * 1.01 if v.is_floating_point() else v
                                                 for k, v in update.tensors.items()})
    moved = dataclasses.replace(moved, checksum=checksum(moved.tensors))
    with pytest.raises(WeightSyncError, match="differs from the learner's .*: the update was not applied"):
        worker.update_weights(moved)
    actor = ray.remote(num_cpus=0)(RolloutWorker).remote(tiny_path, "hf")
    try:
        with pytest.raises(WeightSyncError, match="rollout worker 0 reports policy version 0 after the update to "
                                                  "version 7: it did not apply the update"):
            RolloutFleet([actor]).update_weights(ray.put(update), 7)
        with pytest.raises(WeightSyncError, match="rollout worker 0: .*differs from the learner's"):
            RolloutFleet([actor]).update_weights(ray.put(corrupted), 0)
    finally:
        ray.kill(actor)
