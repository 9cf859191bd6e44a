"""Two-node scenario, run by tests/test_two_nodes.py in a process of its own (the
suite's other tests hold a single-node Ray in theirs).

``python tests/two_nodes.py TMP_DIR MODEL_DIR`` starts a two-node cluster with
``ray.cluster_utils.Cluster`` (one CPU per node), then

1. builds a TrainJob in a STRICT_SPREAD placement group, so its learner and its
   rollout worker land on different nodes, trains the learner, and measures how far
   the worker's sampler logprobs are from the learner's before and after a weight
   sync through the object store;
2. submits a job through the ResourceManager (STRICT_SPREAD, checkpoint at step 1),
   deletes the job's own copy of its checkpoints, and resumes a second job from
   ``JOB_ID:1``, which can only get the checkpoint through Ray.

Prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def job_config(tmp: Path, model: str, **checkpoint) -> dict:
    return {"job": {"name": "two-nodes", "output_dir": str(tmp / "runs")}, "model": {"path": model},
            "rollout": {"backend": "hf", "max_model_len": 64},
            "resources": {"strategy": "STRICT_SPREAD"},
            "algo": {"steps": 2, "batch_size": 2, "drop_uniform_groups": False},
            "eval": {"num_samples": 4}, "checkpoint": {"save_at_end": False, **checkpoint},
            "envs": {"arithmetic": {
                "entry": "envs.arithmetic:Arithmetic", "num_rollouts": 2, "max_tokens_per_turn": 3,
                "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": str(tmp / "data"),
                            "kwargs": {"num_eval": 10}},
                "splits": {"train": {}, "eval": {"shuffle": False}}}}}


def sampler_learner_gap(job, prompt: list[int]) -> float:
    """Largest |sampler logprob - learner logprob| over 8 sampled tokens."""
    import ray

    from otray.algos.datums import sft_datum
    from otray.types import SamplingParams

    sample = job.main.fleet.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))[0]
    tokens, q = sample.samples[0].token_ids, sample.samples[0].logprobs
    lp = ray.get(job.main.learner.forward.remote([sft_datum(prompt, tokens)]))[0][-len(tokens):]
    return max(abs(a - b) for a, b in zip(lp, q))


def main(tmp: Path, model: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    from otray import config
    from otray.actors.job import TrainJob
    from otray.actors.runtime import SUPERVISED
    from otray.client import connect
    from otray.models import chat_prompt_ids

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"side_a": 1}})
    cluster.add_node(num_cpus=1, resources={"side_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="otray", log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}})
    out: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        # 1. learner and rollout worker on different nodes; weight sync through the object store
        cfg = config.load(job_config(tmp, model))
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(pg.ready(), timeout=60)
        job = TrainJob(cfg, tmp / "direct", placement_group=pg, log=lambda _: None)
        out["direct_nodes"] = job.main.nodes
        prompt = chat_prompt_ids(job.tokenizer, [{"role": "user", "content": "12+34="}])
        out["gap_at_start"] = sampler_learner_gap(job, prompt)
        for step in range(1, 4):  # big steps, so that the policy moves
            job.main.update(job.sft.env_batch(job.env_splits["arithmetic"]["train"].sample(16)), SUPERVISED, cfg.algo, 5e-3)
        out["gap_before_sync"] = sampler_learner_gap(job, prompt)
        out["sync_s"] = job.main.sync_weights()
        out["gap_after_sync"] = sampler_learner_gap(job, prompt)
        for handle in (job.main.learner, *job.main.fleet.workers):
            ray.kill(handle)
        remove_placement_group(pg)

        # 2. through the ResourceManager; the resumed job gets its checkpoint through Ray
        client = connect(db_path=str(tmp / "registry.db"))
        first = client.submit(job_config(tmp, model, save_every=1))
        out["first"] = first.wait(timeout=300)
        out["first_summary"] = json.loads((tmp / "runs" / first.id / "summary.json").read_text())
        out["first_batches"] = {r["step"]: r["batch"] for r in first.metrics() if r["phase"] == "grpo"}
        shutil.rmtree(tmp / "runs" / first.id / "checkpoints")
        second = client.submit(job_config(tmp, model, resume_from=f"{first.id}:1"))
        out["second"] = second.wait(timeout=300)
        out["second_batches"] = {r["step"]: r["batch"] for r in second.metrics() if r["phase"] == "grpo"}

        # 3. a sharded learner (learner_workers=2) whose ranks are on different nodes
        out["sharded"] = sharded_across_nodes(tmp, model)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def sharded_across_nodes(tmp: Path, model: str) -> dict:
    """Rank 0 on one node, rank 1 on the other (bundles pinned by the nodes' custom resources): train,
    sync the rollout worker, save (rank 1's shard crosses to rank 0's node) and load the checkpoint
    into a plain PolicyLearner here."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from otray import config
    from otray.actors.job import TrainJob
    from otray.actors.learner import PolicyLearner
    from otray.actors.runtime import SUPERVISED
    from otray.models import chat_prompt_ids

    data = job_config(tmp, model)
    data["resources"] = {"learner_workers": 2, "learner_cpus": 0.5, "rollout_cpus": 0.5, "strategy": "SPREAD"}
    cfg = config.load(data)
    pg = placement_group([{"CPU": 0.5, "side_a": 0.5}, {"CPU": 0.5, "side_b": 0.5}, {"CPU": 0.5}], strategy="SPREAD")
    ray.get(pg.ready(), timeout=60)
    job = TrainJob(cfg, tmp / "sharded", placement_group=pg, log=lambda _: None)
    seen: dict = {"rank_nodes": ray.get(job.main.learner.rank_nodes.remote())}
    prompt = chat_prompt_ids(job.tokenizer, [{"role": "user", "content": "12+34="}])
    for _ in range(2):
        job.main.update(job.sft.env_batch(job.env_splits["arithmetic"]["train"].sample(16)), SUPERVISED, cfg.algo, 5e-3)
    job.main.sync_weights()
    seen["gap_after_sync"] = sampler_learner_gap(job, prompt)
    ckpt = tmp / "sharded" / "ckpt"
    ray.get(job.main.learner.save_state.remote(str(ckpt), {}))
    seen["files"] = sorted(p.name for p in (ckpt / "dcp").iterdir())
    probe = job.sft.env_batch(job.env_splits["arithmetic"]["train"].sample(4))
    plain = PolicyLearner(model, seed=0)
    plain.load_state(str(ckpt))
    theirs = ray.get(job.main.learner.forward.remote(probe))
    seen["reload_gap"] = max(abs(a - b) for x, y in zip(plain.forward(probe), theirs) for a, b in zip(x, y))
    ray.kill(job.main.learner)
    for handle in job.main.fleet.workers:
        ray.kill(handle)
    remove_placement_group(pg)
    return seen


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2]), default=str))
