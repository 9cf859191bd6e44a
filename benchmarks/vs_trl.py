"""otray vs TRL's GRPOTrainer, side by side on this machine.

Two comparisons, each alternating otray and TRL runs (otray, TRL, otray, TRL, ...) so
machine noise hits both; every run is its own process; round k uses seed k on both sides.

1. Learning, tiny model: the same SFT-warmed tiny checkpoint (otray's SFT job, built
   once and cached), the same arithmetic prompts (chat template, user turn = the
   question), the same reward (``envs.arithmetic.Arithmetic``'s own ``step``), batch
   size, group size, max new tokens, temperature, learning rate (constant), clip range
   (0.8 / 1.2), per-group z-scored advantages, token-mean loss over the batch, no KL
   term, and number of steps. (a) ``python -m otray.train`` on a local Ray (HF
   backend; by default ``rollout.colocate``: the learner actor generates, as TRL's
   trainer does, ``--rollout workers`` for a separate rollout worker actor);
   (b) ``trl.GRPOTrainer`` in one process.
   Per-step wall time (median, min, max over all runs' steps but each run's first) and
   held-out accuracy after the last step, measured the same way for both (greedy, the
   first ``--eval-problems`` problems of the held-out split, otray's HF backend).
2. Throughput, ~100M parameters: otray's ``100m`` Qwen2 shape, randomly initialized,
   64 new tokens per completion (``ignore_eos`` / ``min_new_tokens``), a coin-flip
   reward (``envs.coin``) so every group trains; step time and generated tokens/s.

Differences that stay: otray drops groups whose rewards are all equal (no gradient
would come from them; ``algo.drop_uniform_groups``, its default) and TRL runs them
through the learner with zero advantages; otray runs its learner in a Ray actor (2 torch
threads) next to the Ray processes and the driver, TRL is one process with 2 threads.

Prints both tables; saves ``benchmarks/results/vs_trl.json`` and
``benchmarks/results/vs_trl_learning.png`` (reward vs wall time).

    python benchmarks/vs_trl.py [--learn-rounds 10] [--rounds 3] [--learn-steps 30] [--tput-steps 6]
                                [--only learn|throughput]

Needs TRL and matplotlib: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / ".cache" / "bench"
THREADS = 2

# what both frameworks get, per comparison
LEARN = {"batch_size": 32, "group_size": 8, "max_new_tokens": 6, "learning_rate": 5e-4, "temperature": 1.0}
TPUT = {"batch_size": 2, "group_size": 4, "max_new_tokens": 64, "learning_rate": 1e-5, "temperature": 1.0}


def sh(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        tail = log.read_text().splitlines()[-25:]
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {rc}); log {log}:\n" + "\n".join(tail))


# --------------------------------------------------------------------------- inputs


def data_dir() -> Path:
    from envs.arithmetic import make_dataset

    out = CACHE / "arithmetic"
    make_dataset(out, num_eval=500)
    return out


def sft_checkpoint() -> Path:
    """The tiny model after the demo's SFT warm-up (2-digit addition until 30% of training problems
    are right, as ``make demo`` does, so RL has room to improve it), built once."""
    out = CACHE / "sft-tiny"
    model = out / "model"
    if not (model / "config.json").exists():
        print("building the SFT-warmed tiny checkpoint (otray SFT job, ~2 minutes) ...", flush=True)
        shutil.rmtree(CACHE / "runs" / "vs_trl_sft", ignore_errors=True)
        sh([sys.executable, "-m", "otray.train", "conf/arithmetic_grpo.yaml", "job.name=vs_trl_sft", "algo.steps=0",
            f"job.output_dir={CACHE}/runs", "eval.every=0", "checkpoint.save_every=0"], CACHE / "sft.log")
        ck = sorted((CACHE / "runs" / "vs_trl_sft" / "checkpoints").iterdir())[-1] / "model"
        out.mkdir(parents=True, exist_ok=True)
        os.replace(ck, model)
    return model


def model_100m() -> Path:
    from otray.models import build_tiny_model

    out = CACHE / "model-100m"
    if not (out / "config.json").exists():
        build_tiny_model(str(out), 0, "100m")
    return out


# --------------------------------------------------------------------------- otray side


def otray_run(name: str, model: Path, env: str, s: dict, steps: int, data: Path, extra: list[str],
              colocate: bool, seed: int) -> dict:
    run_dir = CACHE / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    entry = {"arithmetic": "envs.arithmetic:Arithmetic", "coin": "envs.coin:CoinFlip"}[env]
    cfg = {
        "job": {"name": name, "seed": seed, "output_dir": str(CACHE / "runs")},
        "model": {"path": str(model)},
        "rollout": {"backend": "hf", "num_workers": 1, "max_model_len": 128, "max_batch": 512, "colocate": colocate},
        "resources": {"learner_cpus": 1, "rollout_cpus": 1, "learner_threads": THREADS, "rollout_threads": THREADS},
        "algo": {"loss_fn": "ppo", "advantage": "zscore", "aggregation": "token_mean",
                 "learning_rate": s["learning_rate"], "steps": steps, "batch_size": s["batch_size"]},
        "eval": {"every": 0, "num_samples": 1},
        "checkpoint": {"save_every": 0, "save_at_end": True},
        "envs": {env: {"entry": entry, "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": str(data),
                                                   "kwargs": {"num_eval": 500}},
                       "splits": {"train": {"shuffle": True}, "eval": {"shuffle": False}},
                       "num_rollouts": s["group_size"], "temperature": s["temperature"],
                       "max_tokens_per_turn": s["max_new_tokens"], "ignore_eos": env == "coin"}},
    }
    path = CACHE / f"{name}.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    sh([sys.executable, "-m", "otray.train", str(path), *extra], CACHE / f"{name}.log")
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["phase"] == "grpo"]
    ck = sorted((run_dir / "checkpoints").iterdir())[-1] / "model"
    elapsed, t = [], 0.0
    for r in grpo:
        t += r["step_wall_s"]
        elapsed.append(t)
    return {"framework": "otray", "process_s": wall, "step_s": [r["step_wall_s"] for r in grpo],
            "reward": [r["reward_mean"] for r in grpo], "elapsed_s": elapsed,
            "tokens": [r["tokens_per_s"] * r["rollout_s"] for r in grpo],
            "generate_s": [r["time/generate_s"] for r in grpo], "model": str(ck),
            "breakdown_s": {k[5:-2]: [r[k] for r in grpo] for k in grpo[0] if k.startswith("time/") and k.endswith("_s")}}


# --------------------------------------------------------------------------- TRL side (own process)


def trl_main(spec: dict) -> None:
    import torch

    torch.set_num_threads(THREADS)
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from otray.types import Task

    s, env_name = spec["settings"], spec["env"]
    rows = pq.read_table(Path(spec["data"]) / "train.parquet").to_pylist()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"],
                             "question": r["question"]} for r in rows])

    def reward(completions, answer, question, **_):
        from envs.arithmetic import Arithmetic
        from envs.coin import CoinFlip

        out = []
        for c, a, q in zip(completions, answer, question):
            env = Arithmetic() if env_name == "arithmetic" else CoinFlip()
            env.reset(Task("x", env_name, {"question": q, "answer": a}))
            out.append(env.step(c[0]["content"] if isinstance(c, list) else c).reward)
        return out

    times: list[float] = []
    tokens: list[int] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter())

    n = s["batch_size"] * s["group_size"]
    gen_kwargs = {"min_new_tokens": s["max_new_tokens"]} if spec["ignore_eos"] else {}
    cfg = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=spec["steps"], per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=s["group_size"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        learning_rate=s["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        weight_decay=0.0, optim="adamw_torch", beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        num_iterations=1, generation_kwargs=gen_kwargs, dataloader_num_workers=0, seed=spec["seed"],
        disable_dropout=True)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    sys.path.insert(0, str(ROOT))
    from benchmarks.trl_side import model_with_timed_generate

    model, generate_s = model_with_timed_generate(spec["model"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for h in logs:
        tokens.append(h.get("completions/mean_length", 0.0) * n)
    trainer.save_model(spec["out"] + "/model")
    tok.save_pretrained(spec["out"] + "/model")
    steps = [b - a for a, b in zip(times, times[1:])]
    elapsed = [t - times[0] for t in times[1:]]
    Path(spec["out"], "result.json").write_text(json.dumps({
        "framework": "trl", "process_s": wall, "step_s": steps, "reward": [h["reward"] for h in logs],
        "elapsed_s": elapsed, "tokens": tokens, "model": spec["out"] + "/model", "generate_s": generate_s}))


def trl_run(name: str, model: Path, env: str, s: dict, steps: int, data: Path, seed: int) -> dict:
    out = CACHE / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {"model": str(model), "env": env, "settings": s, "steps": steps, "data": str(data), "out": str(out),
            "ignore_eos": env == "coin", "seed": seed}
    sh([sys.executable, __file__, "--trl-run", json.dumps(spec)], CACHE / f"{name}.log")
    return json.loads((out / "result.json").read_text())


# --------------------------------------------------------------------------- held-out accuracy


def accuracy(model_dir: str, data: Path, problems: int) -> float:
    """Greedy accuracy on the first ``problems`` held-out problems; one code path for both frameworks."""
    import pyarrow.parquet as pq
    import torch

    from envs.arithmetic import Arithmetic
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import chat_prompt_ids, load_tokenizer
    from otray.types import SamplingParams, Task

    torch.set_num_threads(THREADS)
    rows = pq.read_table(data / "eval.parquet").to_pylist()[:problems]
    tok, backend = load_tokenizer(model_dir), HFBackend(model_dir, max_model_len=128)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": r["question"]}]) for r in rows]
    samples = backend.generate(prompts, SamplingParams(max_tokens=LEARN["max_new_tokens"], temperature=0.0), 1)
    right = 0
    for r, (sample,) in zip(rows, samples):
        env = Arithmetic()
        env.reset(Task(r["id"], "arithmetic", r))
        right += env.step(tok.decode(sample.token_ids, skip_special_tokens=True)).reward > 0
    return right / len(rows)


# --------------------------------------------------------------------------- report


def steady(runs: list[dict]) -> list[float]:
    """Every step time but each run's first (which includes warm-up work on both sides)."""
    return [x for r in runs for x in r["step_s"][1:]]


def summary(runs: list[dict]) -> dict:
    xs = steady(runs)
    return {"median_step_s": statistics.median(xs), "min_step_s": min(xs), "max_step_s": max(xs), "steps": len(xs)}


def heldout_stats(runs: list[dict]) -> dict:
    """Mean held-out accuracy over runs, with its spread (runs differ by seed: data order and sampling)."""
    xs = [r["heldout_accuracy"] for r in runs]
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return {"heldout_after": statistics.mean(xs), "heldout_sd": sd, "heldout_se": sd / len(xs) ** 0.5}


def difference(a: dict, b: dict) -> dict:
    """``a - b`` of the mean held-out accuracies, its standard error, Welch's t, a 95% interval and a verdict.

    Runs differ by seed (data order and sampling), by ~7 points of held-out accuracy on
    either side, so "equal or better" is a statistical statement: ``better`` / ``worse``
    when the 95% interval excludes 0, else ``no significant difference``."""
    mean = a["heldout_after"] - b["heldout_after"]
    se = (a["heldout_se"] ** 2 + b["heldout_se"] ** 2) ** 0.5
    low, high = mean - 1.96 * se, mean + 1.96 * se
    verdict = "better" if low > 0 else "worse" if high < 0 else "no significant difference"
    return {"mean": mean, "se": se, "t": mean / se if se else 0.0, "ci95": [low, high], "verdict": verdict}


def plot(learn: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for fw, color in (("otray", "tab:blue"), ("trl", "tab:orange")):
        for i, r in enumerate(learn["runs"][fw]):
            ax.plot(r["elapsed_s"], r["reward"], color=color, alpha=0.8, label=f"{fw}" if i == 0 else None)
    ax.set_xlabel("wall time in training steps (s)")
    ax.set_ylabel("mean reward of the step's batch")
    ax.set_title("GRPO on 2-digit addition, tiny model (SFT-warmed): otray vs TRL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learn-rounds", type=int, default=10,
                    help="otray/TRL pairs in the learning comparison (held-out accuracy varies by seed, ~7 points "
                         "sd on both sides; 10 rounds keep the whole script under 25 minutes here)")
    ap.add_argument("--rounds", type=int, default=3, help="otray/TRL pairs in the throughput comparison")
    ap.add_argument("--learn-steps", type=int, default=30)
    ap.add_argument("--tput-steps", type=int, default=6)
    ap.add_argument("--eval-problems", type=int, default=500)
    ap.add_argument("--only", choices=("learn", "throughput"), default=None)
    ap.add_argument("--rollout", choices=("colocated", "workers"), default="colocated",
                    help="otray generates in the learner actor (rollout.colocate) or in a rollout worker actor")
    ap.add_argument("--trl-run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_run:
        return trl_main(json.loads(args.trl_run))
    try:
        import matplotlib  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{e.name} is missing: pip install -e '.[bench]' (TRL's pins fit otray's venv)") from None
    t_all = time.perf_counter()
    CACHE.mkdir(parents=True, exist_ok=True)
    data = data_dir()
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads": THREADS},
           "command": "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:]), "args": vars(args)}
    import trl as trl_mod

    out["trl_version"] = trl_mod.__version__

    if args.only in (None, "learn"):
        sft = sft_checkpoint()
        start_acc = accuracy(str(sft), data, args.eval_problems)
        runs: dict[str, list[dict]] = {"otray": [], "trl": []}
        for k in range(args.learn_rounds):
            print(f"learning, round {k + 1}/{args.learn_rounds}: otray ...", flush=True)
            runs["otray"].append(otray_run(f"learn_otray_{k}", sft, "arithmetic", LEARN, args.learn_steps, data, [],
                                           args.rollout == "colocated", seed=k))
            print(f"learning, round {k + 1}/{args.learn_rounds}: TRL ...", flush=True)
            runs["trl"].append(trl_run(f"learn_trl_{k}", sft, "arithmetic", LEARN, args.learn_steps, data, seed=k))
        for fw in runs:
            for r in runs[fw]:
                r["heldout_accuracy"] = accuracy(r["model"], data, args.eval_problems)
        learn = {"settings": LEARN, "steps": args.learn_steps, "heldout_before": start_acc, "runs": runs,
                 **{fw: {**summary(runs[fw]), **heldout_stats(runs[fw])} for fw in runs}}
        learn["heldout_difference"] = difference(learn["otray"], learn["trl"])
        learn["step_time_ratio"] = learn["otray"]["median_step_s"] / learn["trl"]["median_step_s"]
        out["learning"] = learn
        RESULTS.mkdir(exist_ok=True)
        plot(learn, RESULTS / "vs_trl_learning.png")

    if args.only in (None, "throughput"):
        big = model_100m()
        runs = {"otray": [], "trl": []}
        for k in range(args.rounds):
            print(f"throughput (~100M), round {k + 1}/{args.rounds}: otray ...", flush=True)
            runs["otray"].append(otray_run(f"tput_otray_{k}", big, "coin", TPUT, args.tput_steps, data,
                                           ["algo.drop_uniform_groups=false"], args.rollout == "colocated", seed=k))
            print(f"throughput (~100M), round {k + 1}/{args.rounds}: TRL ...", flush=True)
            runs["trl"].append(trl_run(f"tput_trl_{k}", big, "coin", TPUT, args.tput_steps, data, seed=k))
        tput = {"settings": TPUT, "steps": args.tput_steps, "runs": runs}
        for fw in runs:
            steps = [(s, t) for r in runs[fw] for s, t in list(zip(r["step_s"], r["tokens"]))[1:]]
            tput[fw] = {**summary(runs[fw]), "tokens_per_step": statistics.median(t for _, t in steps),
                        "generated_tokens_per_s_of_step": statistics.median(t / s for s, t in steps)}
        tput["trl"]["generate_median_s"] = statistics.median(x for r in runs["trl"] for x in r["generate_s"][1:])
        tput["otray"]["breakdown_median_s"] = {
            part: statistics.median(x for r in runs["otray"] for x in r["breakdown_s"][part][1:])
            for part in runs["otray"][0]["breakdown_s"]}
        tput["step_time_ratio"] = tput["otray"]["median_step_s"] / tput["trl"]["median_step_s"]
        out["throughput"] = tput

    out["total_s"] = time.perf_counter() - t_all
    RESULTS.mkdir(exist_ok=True)
    if args.only and (RESULTS / "vs_trl.json").exists():  # keep the other comparison's latest figures
        kept = json.loads((RESULTS / "vs_trl.json").read_text())
        other = "throughput" if args.only == "learn" else "learning"
        if other in kept:
            out[other] = kept[other]
            out[f"{other}_command"] = kept.get(f"{other}_command", kept.get("command"))
    out[f"{'throughput' if args.only == 'throughput' else 'learning'}_command"] = out["command"]
    (RESULTS / "vs_trl.json").write_text(json.dumps(out, indent=1))
    print()
    if "learning" in out:
        L = out["learning"]
        print(f"Learning, tiny model, {L['steps']} steps x {len(L['runs']['otray'])} runs each "
              f"(batch {LEARN['batch_size']} x {LEARN['group_size']}, {LEARN['max_new_tokens']} new tokens); "
              f"held-out accuracy before: {L['heldout_before']:.3f}")
        print(f"{'':8} {'median step':>12} {'min':>7} {'max':>7} {'held-out after':>15}")
        for fw in ("otray", "trl"):
            r = L[fw]
            print(f"{fw:8} {r['median_step_s']:11.3f}s {r['min_step_s']:6.3f}s {r['max_step_s']:6.3f}s "
                  f"{r['heldout_after']:15.3f}")
        print("held-out after, per run (round k = seed k): " + "; ".join(
            f"{fw} " + ", ".join(f"{r['heldout_accuracy']:.3f}" for r in L["runs"][fw]) for fw in ("otray", "trl")))
        D = L["heldout_difference"]
        print(f"held-out after, otray - TRL: {D['mean']:+.3f} (standard error {D['se']:.3f}, Welch t {D['t']:+.2f}, "
              f"95% interval [{D['ci95'][0]:+.3f}, {D['ci95'][1]:+.3f}]): {D['verdict']} "
              f"(target: equal or better, i.e. not 'worse')")
        print(f"otray / TRL median step time: {L['step_time_ratio']:.2f} (target <= 1.0)\n")
    if "throughput" in out:
        T = out["throughput"]
        print(f"Throughput, ~100M Qwen2 shape, {TPUT['max_new_tokens']} new tokens, batch {TPUT['batch_size']} x "
              f"{TPUT['group_size']}, {T['steps']} steps x {len(T['runs']['otray'])} runs each (first step of each run excluded)")
        print(f"{'':8} {'median step':>12} {'min':>7} {'max':>7} {'gen tok/s of step':>18}")
        for fw in ("otray", "trl"):
            r = T[fw]
            print(f"{fw:8} {r['median_step_s']:11.2f}s {r['min_step_s']:6.2f}s {r['max_step_s']:6.2f}s "
                  f"{r['generated_tokens_per_s_of_step']:18.1f}")
        print(f"otray / TRL median step time: {T['step_time_ratio']:.2f} (target <= 0.8)")
        print("otray step breakdown (median s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in T["otray"]["breakdown_median_s"].items() if v >= 0.005))
        print(f"TRL's time in model.generate (median s): {T['trl']['generate_median_s']:.2f}")
    print(f"\nsaved {RESULTS / 'vs_trl.json'} in {out['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
