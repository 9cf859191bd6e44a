"""otray against TRL's GRPOTrainer on one GPU (or the CPU), same model, same work, in one script.

    python benchmarks/gpu.py                                   # on a GPU: the 0.5B shape with a 32k vocabulary
    python benchmarks/gpu.py --device cpu --shape tiny --rounds 1 --steps 2 --prompts 2 --group 2 --new-tokens 8
                                                               # the smoke run of the test suite

The model is built here (no hub): Qwen2.5-0.5B's transformer blocks, randomly initialised, with a byte-level
BPE tokenizer of 32,768 entries trained on the spot (``otray.models``' ``tiny-0.5b_32k``: 386M parameters).
Every step: ``--prompts`` prompts x ``--group`` completions of exactly ``--new-tokens`` new tokens
(``ignore_eos`` / TRL's ``min_new_tokens``), a reward of one hash bit (``envs.coin``) so every group trains,
bf16 compute with float32 master weights on a GPU (float32 on the CPU), AdamW, no KL term.

Rows, each run in its own process and the rows alternating within every round (TRL, then each otray row;
the first row rotates by round):

- ``trl``: ``trl.GRPOTrainer`` (generation through the model's own ``generate``);
- ``otray_colocated_eager``: ``python -m otray.train`` with ``rollout.colocate`` (the learner samples) and
  ``rollout.sampler: eager``;
- ``otray_colocated_compiled``: the same with ``rollout.sampler: compiled`` (its warm-up, paid when the
  learner starts, is ``compile_s``, outside every step);
- ``otray_split``: a learner and one rollout worker (half a GPU each on a GPU), ``rollout.weight_sync:
  auto`` (``cuda_ipc`` on one GPU, ``shm`` on the CPU), the compiled sampler on a GPU.

Figures per row (the first step of each run is left out): median step seconds, the median generation /
learning / weight-sync seconds within a step, tokens/(s x GPU) (prompt and new tokens of the step over the
step's time and the GPUs used), the learner's peak GPU memory, and the ratio of the median step to TRL's.
Saved as JSON (``--out``, default ``benchmarks/results/gpu.json``). Targets (issue 51, one H100/H200):
colocated compiled / TRL <= 0.30 (goal 0.15); compiled generation of 64 x 256 tokens <= 1.5 s; weight
sync <= 0.05 s between a learner and a worker on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402
from benchmarks.trl_side import model_with_timed_generate  # noqa: E402

OTRAY_ROWS = ("otray_colocated_eager", "otray_colocated_compiled", "otray_split")
FIELDS = ("median_step_s", "generate_s", "learn_s", "sync_s", "tokens_per_s_per_gpu", "peak_gpu_gb",
          "ratio_to_trl", "step_s")


def run(cmd: list[str], log: Path, timeout: float) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}); last lines of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-25:]))


# --------------------------------------------------------------------------- otray rows


def otray_config(row: str, a: argparse.Namespace, model: str, data: Path, work: Path, seed: int) -> dict:
    gpu = a.device == "cuda"
    split = row == "otray_split"
    sampler = "eager" if row == "otray_colocated_eager" else ("compiled" if gpu or not split else "auto")
    return {
        "job": {"name": f"{row}_{seed}", "seed": seed, "output_dir": str(work / "runs")},
        "model": {"path": model, "dtype": "auto", "device": a.device},
        "rollout": {"backend": "hf", "colocate": not split, "num_workers": 1, "sampler": sampler,
                    "max_model_len": a.prompt_room + a.new_tokens, "max_batch": a.prompts * a.group,
                    "weight_sync": "auto"},
        "resources": {"learner_cpus": 1, "rollout_cpus": 1, "learner_gpus": (0.5 if split else 1) if gpu else 0,
                      "rollout_gpus": 0.5 if gpu and split else 0,
                      "learner_threads": a.threads, "rollout_threads": a.threads},
        "sft": {"steps": 0},
        "algo": {"loss_fn": "ppo", "advantage": "zscore", "aggregation": "token_mean", "learning_rate": 1e-6,
                 "steps": a.steps, "batch_size": a.prompts, "micro_batch_tokens": 0 if gpu else 8192,
                 "drop_uniform_groups": False},
        "eval": {"every": 0, "num_samples": 1},
        "checkpoint": {"save_every": 0, "save_at_end": False},
        "envs": {"coin": {"entry": "envs.coin:CoinFlip",
                          "dataset": {"builder": "envs.arithmetic:make_dataset", "dir": str(data),
                                      "kwargs": {"num_eval": 20}},
                          "splits": {"train": {"shuffle": True}, "eval": {"shuffle": False}},
                          "num_rollouts": a.group, "temperature": 1.0, "max_tokens_per_turn": a.new_tokens,
                          "ignore_eos": True}},
    }


def otray_run(row: str, a: argparse.Namespace, model: str, data: Path, work: Path, seed: int) -> dict:
    cfg = otray_config(row, a, model, data, work, seed)
    run_dir = work / "runs" / cfg["job"]["name"]
    shutil.rmtree(run_dir, ignore_errors=True)
    path = work / f"{cfg['job']['name']}.json"
    path.write_text(json.dumps(cfg))
    run([sys.executable, "-m", "otray.train", str(path), "--address", "local"], work / f"{cfg['job']['name']}.log", a.run_timeout)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["phase"] == "grpo"]

    def part(r: dict, *names: str) -> float:
        return sum(r.get(f"time/{n}_s", 0.0) for n in names)

    return {"step_s": [r["step_wall_s"] for r in grpo], "generate_s": [part(r, "generate") for r in grpo],
            "learn_s": [part(r, "forward_backward", "optim_step") for r in grpo],
            "sync_s": [r.get("sync_s", 0.0) for r in grpo],
            "peak_gpu_gb": max((r.get("learner/peak_gpu_gb") or 0.0 for r in grpo), default=0.0) or None,
            "sampler": grpo[0].get("sampler"), "compile_s": grpo[0].get("sampler_compile_s"),
            "weight_sync": grpo[0].get("weight_sync"), "gpus": 1 if a.device == "cuda" else 0}


# --------------------------------------------------------------------------- the TRL row (own process)


def trl_main(spec: dict) -> None:
    import torch
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.coin import coin

    torch.set_num_threads(spec["threads"])
    gpu = spec["device"] == "cuda"
    rows = pq.read_table(Path(spec["data"]) / "train.parquet").to_pylist()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]} for r in rows])

    def reward(completions, **_):
        return [coin(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if gpu:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            if gpu:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    n = spec["prompts"] * spec["group"]
    cfg = GRPOConfig(
        output_dir=spec["out"], use_cpu=not gpu, bf16=gpu, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=spec["steps"], per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=spec["group"], max_completion_length=spec["new_tokens"], temperature=1.0,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        optim="adamw_torch_fused" if gpu else "adamw_torch", beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", num_iterations=1, generation_kwargs={"min_new_tokens": spec["new_tokens"]},
        dataloader_num_workers=0, seed=spec["seed"], disable_dropout=True)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model, generate_s = model_with_timed_generate(spec["model"], cuda=gpu)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    steps = [marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)]
    Path(spec["out"], "result.json").write_text(json.dumps({
        "step_s": steps, "generate_s": generate_s[:len(steps)],
        "learn_s": [s - g for s, g in zip(steps, generate_s)], "sync_s": [0.0] * len(steps),
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "sampler": "hf generate", "compile_s": 0.0, "weight_sync": "none", "gpus": 1 if gpu else 0}))


def trl_run(a: argparse.Namespace, model: str, data: Path, work: Path, seed: int) -> dict:
    out = work / "runs" / f"trl_{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {"model": model, "data": str(data), "out": str(out), "seed": seed, "device": a.device,
            "threads": a.threads, "steps": a.steps, "prompts": a.prompts, "group": a.group,
            "new_tokens": a.new_tokens}
    run([sys.executable, __file__, "--trl-run", json.dumps(spec)], work / f"trl_{seed}.log", a.run_timeout)
    return json.loads((out / "result.json").read_text())


# --------------------------------------------------------------------------- figures


def prompt_tokens(model: str, data: Path, n: int) -> float:
    """The mean chat-prompt length of the first ``n`` training questions (both sides' prompts)."""
    import pyarrow.parquet as pq

    from otray.models import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(model)
    rows = pq.read_table(data / "train.parquet").to_pylist()[:n]
    return statistics.mean(len(chat_prompt_ids(tok, [{"role": "user", "content": r["question"]}])) for r in rows)


def figures(runs: list[dict], tokens_per_step: float) -> dict:
    later = lambda key: [x for r in runs for x in r[key][1:]]  # noqa: E731 - each run's first step left out
    med = statistics.median(later("step_s"))
    gpus = max(runs[0]["gpus"], 1)
    peaks = [r["peak_gpu_gb"] for r in runs if r["peak_gpu_gb"] is not None]
    return {"median_step_s": med, "generate_s": statistics.median(later("generate_s")),
            "learn_s": statistics.median(later("learn_s")), "sync_s": statistics.median(later("sync_s")),
            "tokens_per_s_per_gpu": tokens_per_step / (med * gpus), "peak_gpu_gb": max(peaks) if peaks else None,
            "step_s": later("step_s"), "sampler": runs[0]["sampler"], "weight_sync": runs[0]["weight_sync"],
            "compile_s": [r["compile_s"] for r in runs], "runs": runs}


def summary(a: argparse.Namespace, model: str, runs: dict[str, list[dict]], errors: dict[str, str],
            tokens_per_step: float, t_all: float, command: str) -> dict:
    """The JSON of the rows run so far (``complete`` false until every run is done; a failed row named in
    ``errors``, with the last lines of its log)."""
    import torch

    table = {row: figures(rs, tokens_per_step) for row, rs in runs.items() if rs}
    trl = table.get("trl")
    for row in table.values():
        row["ratio_to_trl"] = row["median_step_s"] / trl["median_step_s"] if trl else None
    return {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "shape": a.shape,
            "model": model, "settings": {"prompts": a.prompts, "group": a.group, "new_tokens": a.new_tokens,
                                         "steps": a.steps, "rounds": a.rounds, "threads": a.threads},
            "tokens_per_step": tokens_per_step, "rows": table, "errors": errors, "complete": False,
            "total_s": time.perf_counter() - t_all, "command": command}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", default="0.5b_32k", help="an otray.models shape (tiny: the smoke run)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each row, alternating")
    ap.add_argument("--steps", type=int, default=4, help="steps a run (its first is a warm-up, left out)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-room", type=int, default=64, help="tokens of context left for the prompt")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rows", default="trl," + ",".join(OTRAY_ROWS))
    ap.add_argument("--run-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    ap.add_argument("--trl-run", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_run:
        trl_main(json.loads(a.trl_run))
        return 0

    from envs.arithmetic import make_dataset
    from otray.models import resolve_model_path

    t_all = time.perf_counter()
    work = ROOT / ".cache" / "bench" / "gpu"
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path("tiny" if a.shape == "tiny" else f"tiny-{a.shape}", ROOT / ".cache" / "models")
    data = work / "data"
    if not (data / "train.parquet").exists():
        make_dataset(str(data), num_eval=20)
    tokens_per_step = a.prompts * a.group * (prompt_tokens(model, data, 64) + a.new_tokens)
    names = [r for r in a.rows.split(",") if r]
    runs: dict[str, list[dict]] = {r: [] for r in names}
    errors: dict[str, str] = {}
    command = " ".join(["python", "benchmarks/gpu.py", *(argv if argv is not None else sys.argv[1:])])
    for k in range(a.rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        for row in order:
            print(f"round {k + 1}/{a.rounds}: {row} ...", flush=True)
            t0 = time.perf_counter()
            try:
                runs[row].append(trl_run(a, model, data, work, k) if row == "trl"
                                 else otray_run(row, a, model, data, work, k))
            except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                errors[row] = f"{type(e).__name__}: {e}"  # the other rows still run
                print(f"  {row} failed: {errors[row]}", flush=True)
            print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
            # saved after every run: a run cut short by a time cap keeps the rows it finished
            result = summary(a, model, runs, errors, tokens_per_step, t_all, command)
            save(result, a.out)
    result["complete"] = True
    print(f"\n{result['device']}, {a.shape}: {a.prompts} x {a.group} x {a.new_tokens} new tokens a step, "
          f"{a.rounds} run(s) of {a.steps} steps a row")
    print(f"{'row':26} {'step s':>8} {'gen s':>7} {'learn s':>8} {'sync s':>7} {'tok/s/GPU':>10} {'peak GB':>8} "
          f"{'/ TRL':>6}  sampler, sync, compile s")
    for name, r in result["rows"].items():
        print(f"{name:26} {r['median_step_s']:8.3f} {r['generate_s']:7.3f} {r['learn_s']:8.3f} {r['sync_s']:7.4f} "
              f"{r['tokens_per_s_per_gpu']:10.0f} {r['peak_gpu_gb'] or 0:8.2f} "
              f"{r['ratio_to_trl'] if r['ratio_to_trl'] is not None else float('nan'):6.2f}  "
              f"{r['sampler']}, {r['weight_sync']}, {', '.join(f'{c or 0:.1f}' for c in r['compile_s'])}")
    for name, e in errors.items():
        print(f"{name:26} FAILED: {e.splitlines()[0]}")
    save(result, a.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
