"""The sharded learner (resources.learner_workers > 1): two LearnerRank actors over gloo, one core each,
against one PolicyLearner on the same batch; checkpoints across rank counts; a killed rank."""

from __future__ import annotations

import random
import time

import pytest

from otray.actors.learner.policy_learner import PolicyLearner
from otray.actors.learner.group import LearnerGroup, rank_batches, split_for_ranks
from otray.actors.learner.rank import LearnerRank
from otray.types import Datum

LENGTH = 24  # tokens per datum
BUDGET = 4 * LENGTH  # one learner cuts 8 datums into 2 micro-batches of 4: each rank's share


def batch(seed: int, n: int = 8, rl: bool = True) -> list[Datum]:
    """``n`` datums of LENGTH random tokens; RL datums (advantages, sampler logprobs) or SFT ones."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 500) for _ in range(LENGTH + 1)]
        mask = [0.0] * 8 + [1.0] * (LENGTH - 8)
        adv = rng.uniform(-1, 1) if rl else 0.0
        out.append(Datum(ids[:-1], ids[1:], mask, [adv * m for m in mask],
                         [rng.uniform(-6, -4) * m for m in mask], None if rl else list(mask)))
    return out


def start_group(ray, tiny_path: str, n: int = 2, timeout_s: float = 60.0, **kwargs) -> tuple[LearnerGroup, list]:
    ranks = [ray.remote(num_cpus=1)(LearnerRank).remote(tiny_path, rank=r, world_size=n, micro_batch_tokens=BUDGET,
                                                        seed=0, num_threads=1, **kwargs) for r in range(n)]
    group = ray.remote(num_cpus=0)(LearnerGroup).remote(ranks, BUDGET, timeout_s)
    ray.get(group.ping.remote())
    return group, ranks


def max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_split_for_ranks_balances_tokens_and_keeps_order():
    lengths = [40, 10, 10, 10, 10, 20]
    datums = [Datum([1] * n, [1] * n, [1.0] * n, [0.0] * n, [0.0] * n) for n in lengths]
    assert split_for_ranks(datums, 2) == [[0, 1], [2, 3, 4, 5]]  # 50 and 50 tokens
    assert split_for_ranks(datums, 3) == [[0], [1, 2, 3], [4, 5]]
    assert split_for_ranks(datums[:1], 2) == [[], [0]]  # a rank may get nothing: it runs idle passes
    batches, order = rank_batches(datums, 2, 30)  # shortest first: 10 10 10 10 | 20 40
    assert order == [1, 2, 3, 4, 5, 0]
    assert [[len(b) for b in rank] for rank in batches] == [[3, 1], [1, 1]]
    batches, _ = rank_batches(datums[:2], 2, 30)
    assert batches == [[[datums[1]]], [[datums[0]]]]
    batches, _ = rank_batches(datums[1:5], 2, 10)  # 2 + 2 micro-batches of one row each
    assert [len(rank) for rank in batches] == [2, 2]
    batches, _ = rank_batches(datums[:4], 2, 20)  # 10 10 10 | 40: 2 micro-batches and 1
    assert [[len(b) for b in rank] for rank in batches] == [[2, 1], [1, 0]]  # an idle pass pads rank 1


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_two_ranks_update_equals_one_learner(ray_local, tiny_path, lora):
    ray = ray_local
    spec = {"rank": lora, "alpha": 8} if lora else None
    one = PolicyLearner(tiny_path, lora=spec, micro_batch_tokens=BUDGET, seed=0, num_threads=1)
    group, ranks = start_group(ray, tiny_path, lora=spec)
    try:
        data = batch(0)
        assert max(abs(a - b) for x, y in zip(one.forward(data), ray.get(group.forward.remote(data)))
                   for a, b in zip(x, y)) == 0.0  # same weights, same micro-batches: bit for bit
        m1 = one.forward_backward(data, "ppo", {}, "token_mean")
        m2 = ray.get(group.forward_backward.remote(data, "ppo", {}, "token_mean"))
        assert m2["num_tokens"] == m1["num_tokens"] and abs(m2["loss"] - m1["loss"]) < 1e-6
        s1 = one.optim_step(1e-3, grad_clip=1.0)
        s2 = ray.get(group.optim_step.remote(1e-3, (0.9, 0.999), 1e-8, 0.0, 1.0))
        assert abs(s1["grad_norm"] - s2["grad_norm"]) < 1e-5 * s1["grad_norm"]  # global clipping
        w1, w2 = one.weights(), ray.get(group.weights.remote())
        assert w2.kind == ("lora" if lora else "full") and w2.version == w1.version == 1
        assert max_gap(w1.tensors, w2.tensors) < 1e-6
        moved = max_gap(w1.tensors, PolicyLearner(tiny_path, lora=spec, seed=0).weights().tensors)
        assert moved > 1e-4  # the step did change the weights (the comparison above is not vacuous)
    finally:
        for h in (group, *ranks):
            ray.kill(h)


def test_saved_by_two_ranks_loads_into_one_and_into_two(ray_local, tiny_path, tmp_path):
    ray = ray_local
    group, ranks = start_group(ray, tiny_path)
    try:
        ray.get(group.forward_backward.remote(batch(1, rl=False), "cross_entropy", {}, "token_mean"))
        ray.get(group.optim_step.remote(5e-3, (0.9, 0.999), 1e-8, 0.0, 1.0))
        ray.get(group.save_state.remote(str(tmp_path / "ckpt"), {"data": 7}))
        assert sorted(p.name for p in (tmp_path / "ckpt" / "dcp").iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp"]
        probe = batch(2)
        saved = ray.get(group.forward.remote(probe))

        one = PolicyLearner(tiny_path, micro_batch_tokens=BUDGET, seed=0, num_threads=1)
        meta = one.load_state(str(tmp_path / "ckpt"))
        assert meta.extra_state == {"data": 7} and meta.sharded == 2 and one.step == 1
        assert max(abs(a - b) for x, y in zip(one.forward(probe), saved) for a, b in zip(x, y)) < 1e-6

        # the group trains on; then loads its checkpoint back: the logprobs are the saved ones again
        ray.get(group.forward_backward.remote(batch(3, rl=False), "cross_entropy", {}, "token_mean"))
        ray.get(group.optim_step.remote(5e-3, (0.9, 0.999), 1e-8, 0.0, 1.0))
        assert max(abs(a - b) for x, y in zip(ray.get(group.forward.remote(probe)), saved) for a, b in zip(x, y)) > 1e-3
        ray.get(group.load_state.remote(str(tmp_path / "ckpt")))
        assert ray.get(group.forward.remote(probe)) == saved

        # resume is exact: the same next step (optimizer state included) from 1 rank and from 2
        nxt = batch(4, rl=False)
        one.forward_backward(nxt, "cross_entropy", {}, "token_mean")
        one.optim_step(5e-3)
        ray.get(group.forward_backward.remote(nxt, "cross_entropy", {}, "token_mean"))
        ray.get(group.optim_step.remote(5e-3, (0.9, 0.999), 1e-8, 0.0, 1.0))
        assert max_gap(one.weights().tensors, ray.get(group.weights.remote()).tensors) < 1e-6

        # export: one HF model that transformers loads, with the trained weights
        from transformers import AutoModelForCausalLM

        path = ray.get(group.export.remote(str(tmp_path / "model")))
        hf = AutoModelForCausalLM.from_pretrained(path)
        assert hf.config.architectures == ["Qwen2ForCausalLM"]  # the name vLLM picks its model class by
        assert max_gap({k: v for k, v in hf.state_dict().items()}, one.model.state_dict()) < 1e-6
    finally:
        for h in (group, *ranks):
            ray.kill(h)


def test_a_single_learner_checkpoint_is_refused_by_a_group_with_the_fix(ray_local, tiny_path, tmp_path):
    ray = ray_local
    PolicyLearner(tiny_path, seed=0).save_state(str(tmp_path / "plain"))
    group, ranks = start_group(ray, tiny_path)
    try:
        with pytest.raises(Exception, match="learner_workers: 1"):
            ray.get(group.load_state.remote(str(tmp_path / "plain")))
    finally:
        for h in (group, *ranks):
            ray.kill(h)


def test_a_hung_rank_times_out_the_collective_and_fails_the_group(ray_local, tiny_path):
    """SIGSTOP one rank (alive, never answering): the other's collective gives up after the timeout."""
    import os
    import signal

    ray = ray_local
    group, ranks = start_group(ray, tiny_path, timeout_s=5.0)
    pid = ray.get(ranks[1].__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        with pytest.raises(Exception, match=r"learner rank 0 of 2 \(node \w+\) failed: .*"):
            ray.get(group.forward_backward.remote(batch(0), "ppo", {}, "token_mean"), timeout=120)
        assert time.time() - t0 < 60
        with pytest.raises(Exception, match="failed earlier"):  # the group stays failed
            ray.get(group.info.remote())
    finally:
        os.kill(pid, signal.SIGCONT)
        for h in (group, *ranks):
            ray.kill(h)


def test_a_killed_rank_fails_the_job_within_60_s_and_frees_its_lease(ray_local, tmp_path):
    from tests.conftest import fresh_resource_manager, kill_resource_manager
    from tests.fixtures.jobs import admin_cfg, wait_job

    ray = ray_local
    rm = fresh_resource_manager(tmp_path / "registry.db")
    try:
        data = admin_cfg(tmp_path, steps=500)
        data["resources"] = {"learner_workers": 2, "learner_threads": 1}
        data["job"]["max_failures"] = 0  # (healing by a restart: tests/actors/control/test_gate.py)
        job = ray.get(rm.submit.remote(data, None))
        wait_job(ray, rm, job, None, until="step")
        pg = ray.get(rm.placement_group_id.remote(job, None))
        table = ray._private.state.actors().values()
        pids = [a["Pid"] for a in table if a["ActorClassName"] == "LearnerRank" and a["State"] == "ALIVE"]
        assert len(pids) == 2
        import os
        import signal

        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.time()
        st = wait_job(ray, rm, job, None, timeout=60)
        assert st.state == "FAILED" and "LearnerGroupError: learner rank" in st.error, st
        assert time.time() - killed_at < 60
        assert ray.util.placement_group_table()[pg]["state"] == "REMOVED"
    finally:
        kill_resource_manager()
