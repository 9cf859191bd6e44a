"""What does running a job on Ray cost? The same GRPO steps two ways, side by side:

(a) *ray*: submitted through ``otray.connect().submit(...)``: ResourceManager,
    placement group, JobDriver actor, PolicyLearner and RolloutWorker actors,
    weights through the object store.
(b) *plain*: one process, no Ray: the same ``PolicyLearner`` and ``RolloutWorker``
    classes called directly by the loop below (sample tasks -> roll out -> rewards
    -> advantages -> forward_backward -> optim_step -> load weights).

Settings are the demo's (``conf/arithmetic_grpo.yaml``: batch 32 tasks x 8 rollouts,
HF backend, 2 torch threads per actor) with the SFT warm-up and evaluations off, and
every group trained on (``drop_uniform_groups=false``), so that each step does a full
batch of learner work although the untrained model earns almost no reward.
Per-step time is from sampling the batch to the weights being loaded in the
rollout worker (``step_s`` in the job's metrics), the first step of each run left
out as warm-up. Rounds alternate plain / ray so drift hits both.

Also reported: the time from ``submit`` to the job's first rollout, split into
queueing + actor start-up.

    python benchmarks/overhead.py [--steps 12] [--rounds 2]

Saves ``benchmarks/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "conf" / "arithmetic_grpo.yaml"


def overrides(steps: int, out_dir: str) -> list[str]:
    # uniform groups kept: the untrained model earns little reward, and the learner
    # should do a full batch's work every step, as it does in the demo once SFT is done
    return [f"algo.steps={steps}", "sft.steps=0", "algo.drop_uniform_groups=false", "eval.every=0", "eval.num_samples=1",
            "checkpoint.save_at_end=false", "logging.ray_metrics=false", f"job.output_dir={out_dir}"]


def plain_run(cfg, steps: int) -> dict:
    """The GRPO loop without Ray, on the same classes the actors wrap."""
    from otray.actors.job.episodes import episode_reward, load_splits
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.algos import advantages as adv
    from otray.algos.datums import build_datums
    from otray.config import to_dict
    from otray.actors.rollout.agent_loop import AgentLoop, Limits
    from otray.env import Mixture, resolve
    from otray.models import load_tokenizer, resolve_model_path
    from otray.types import SamplingParams

    t0 = time.perf_counter()
    algo, res, (name, env) = cfg.algo, cfg.resources, next(iter(cfg.envs.items()))
    model = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    learner = PolicyLearner(model, lora=to_dict(cfg)["model"]["lora"], micro_batch_tokens=algo.micro_batch_tokens,
                            seed=cfg.job.seed, num_threads=res.learner_threads)
    worker = RolloutWorker(model, cfg.rollout.backend, num_threads=res.rollout_threads,
                           max_model_len=cfg.rollout.max_model_len, seed=cfg.job.seed)
    tokenizer = load_tokenizer(model)
    mixture = Mixture({name: load_splits(name, env.dataset, env.splits, cfg.job.seed, name)["train"]},
                      {name: 1.0}, seed=cfg.job.seed)
    loop = AgentLoop(tokenizer, worker.generate, Limits(max_turns=1, max_tokens_per_turn=env.max_tokens_per_turn,
                                                         max_tokens_per_episode=env.max_tokens_per_episode,
                                                         max_model_len=cfg.rollout.max_model_len))
    params = SamplingParams(max_tokens=env.max_tokens_per_turn, temperature=env.temperature, top_p=env.top_p)
    startup_s, step_times, tokens, parts = time.perf_counter() - t0, [], 0, {}
    for step in range(steps):
        t1, gen0 = time.perf_counter(), loop.generate_s
        tasks = mixture.sample(algo.batch_size)
        episodes = [(t, resolve(env.entry)(**env.kwargs), cfg.job.seed + step * 1000 + i)
                    for t in tasks for i in range(env.num_rollouts)]
        trajs = loop.run(episodes, params)
        for t in trajs:
            t.reward = episode_reward(t, env)
        kept, advantages = [], []
        for j in range(len(tasks)):
            group = trajs[j * env.num_rollouts:(j + 1) * env.num_rollouts]
            rewards = [t.reward for t in group]
            if len(set(rewards)) > 1 or not algo.drop_uniform_groups:
                kept.extend(group)
                advantages.extend(adv.compute(algo.advantage, rewards))
        datums = build_datums(kept, advantages)
        t2 = time.perf_counter()
        if datums:
            learner.forward_backward(datums, algo.loss_fn, algo.loss_fn_config, algo.aggregation)
            learner.optim_step(algo.learning_rate, tuple(algo.betas), 1e-8, algo.weight_decay, algo.grad_clip)
        t3 = time.perf_counter()
        if datums:
            worker.update_weights(learner.weights())
        step_times.append(time.perf_counter() - t1)
        for key, value in (("rollout_s", t2 - t1), ("generate_s", loop.generate_s - gen0), ("learn_s", t3 - t2),
                           ("sync_s", time.perf_counter() - t3)):
            parts.setdefault(key, []).append(value)
        tokens += sum(t.num_sampled for t in trajs)
    return {"startup_s": startup_s, "step_s": step_times, "sampled_tokens": tokens, **parts}


def ray_run(client, steps: int, out_dir: str) -> dict:
    t_submit = time.time()
    job = client.submit(str(CONFIG), overrides(steps, out_dir))
    final = job.wait(timeout=1800)
    if not final.succeeded:
        raise RuntimeError(f"job {job.id} ended {final.state.value}: {final.error}")
    rows = [r for r in job.metrics() if r["phase"] == "grpo"]
    summary = json.loads((Path(out_dir) / job.id / "summary.json").read_text())
    started = final.started
    return {"step_s": [r["step_s"] for r in rows], "startup_s": summary["startup_s"],
            **{k: [r[k] for r in rows] for k in ("rollout_s", "generate_s", "learn_s", "sync_s", "learner/compute_s")},
            "submit_to_first_rollout_s": summary["first_rollout_at"] - t_submit,
            "submit_to_start_s": started - t_submit, "sampled_tokens": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from otray import config
    from otray.client import connect

    tmp = tempfile.mkdtemp(prefix="otray-overhead-")
    cfg = config.load(CONFIG, overrides(args.steps, tmp))
    client = connect(db_path=str(Path(tmp) / "registry.db"))
    runs: dict[str, list[dict]] = {"plain": [], "ray": []}
    for r in range(args.rounds):
        for kind in ("plain", "ray"):
            out = plain_run(cfg, args.steps) if kind == "plain" else ray_run(client, args.steps, tmp)
            runs[kind].append(out)
            med = {k: statistics.median(out[k][1:]) for k in ("step_s", "rollout_s", "generate_s", "learn_s", "sync_s")}
            print(f"round {r + 1} {kind:>5}: median " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()) +
                  f"; start-up {out['startup_s']:.1f} s", flush=True)

    def steady(kind: str) -> list[float]:
        return [s for run in runs[kind] for s in run["step_s"][1:]]

    plain_s, ray_s = statistics.median(steady("plain")), statistics.median(steady("ray"))
    mean_plain, mean_ray = statistics.fmean(steady("plain")), statistics.fmean(steady("ray"))
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {"config": str(CONFIG.relative_to(ROOT)), "steps_per_run": args.steps, "rounds": args.rounds,
                     "batch_size": cfg.algo.batch_size, "num_rollouts": cfg.envs["arithmetic"].num_rollouts,
                     "backend": cfg.rollout.backend},
        "median_step_s": {"plain": plain_s, "ray": ray_s}, "mean_step_s": {"plain": mean_plain, "ray": mean_ray},
        "ratio_ray_over_plain_median": ray_s / plain_s, "ratio_ray_over_plain_mean": mean_ray / mean_plain,
        "target_ratio": 1.15,
        "submit_to_first_rollout_s": [r["submit_to_first_rollout_s"] for r in runs["ray"]],
        "submit_to_start_s": [r["submit_to_start_s"] for r in runs["ray"]],
        "startup_s": {k: [r["startup_s"] for r in v] for k, v in runs.items()},
        "runs": runs,
    }
    print(f"step time ray/plain: median {result['ratio_ray_over_plain_median']:.3f}, "
          f"mean {result['ratio_ray_over_plain_mean']:.3f} (target <= 1.15)")
    print(f"submit -> first rollout: {', '.join(f'{s:.1f}' for s in result['submit_to_first_rollout_s'])} s")
    out = ROOT / "benchmarks" / "results" / "overhead.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
