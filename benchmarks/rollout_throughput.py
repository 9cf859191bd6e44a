"""Rollout throughput: the RolloutWorker actor vs. calling each backend directly.

For each model size (the tiny model and a randomly initialized ~100M-parameter
Qwen2 shape) and each backend (vLLM, HF), generate a batch of 64 sampled
completions of fixed length (``ignore_eos`` / ``min_new_tokens``) and measure
tokens/s:

- direct: ``vllm.LLM.generate`` / ``model.generate`` in this process, asking for
  the same per-token logprobs the worker returns (logprobs=0 / output_logits).
- worker: ``RolloutWorker.generate`` through a Ray actor with the same CPUs.

For vLLM the worker runs its engine in its own process on the CPU (``engine_settings``' ``in_process``);
``worker_engine_process`` is the same worker with vLLM's own engine and worker processes
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), measured beside it: ``in_process_over_engine_process``.

Prints the worker/direct ratio per (size, backend) and which backend wins at
each size; saves ``benchmarks/results/rollout_throughput.json`` (or ``--out``).

    python benchmarks/rollout_throughput.py [--sizes tiny,100m] [--tokens 32] [--repeats 3] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
RESULTS = Path(__file__).resolve().parent / "results"


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
    from otray.models import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": f"What is {i}+{2 * i}?"}]) for i in range(batch)]


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds over ``repeats`` runs after one warm-up; and the tokens of one run."""
    tokens = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens


def direct_hf(path: str, prompts: list[list[int]], n_tokens: int):
    import torch

    from otray.models import load_model, load_tokenizer

    tok, model = load_tokenizer(path), load_model(path).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1

    @torch.inference_mode()
    def run() -> int:
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                             do_sample=True, temperature=1.0, top_k=0, pad_token_id=tok.pad_token_id,
                             return_dict_in_generate=True, output_logits=True)
        logps = torch.stack(out.logits, 1).float().log_softmax(-1)
        logps.gather(-1, out.sequences[:, width:].unsqueeze(-1))
        return int(out.sequences[:, width:].numel())

    return run, lambda: None


def direct_vllm(path: str, prompts: list[list[int]], n_tokens: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=1.0, logprobs=0, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run() -> int:
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, sp, use_tqdm=False))

    return run, llm.llm_engine.engine_core.shutdown


def via_worker(path: str, backend: str, prompts: list[list[int]], n_tokens: int, cpus: int,
               env: dict[str, str] | None = None):
    import ray

    from otray.actors.sampling.rollout import RolloutWorker
    from otray.types import SamplingParams

    options = {"runtime_env": {"env_vars": env}} if env else {}
    worker = ray.remote(num_cpus=cpus)(RolloutWorker).options(**options).remote(path, backend, num_threads=cpus, max_model_len=512,
                                                             kv_cache_gb=2)
    ray.get(worker.ping.remote())
    params = SamplingParams(max_tokens=n_tokens, temperature=1.0, ignore_eos=True)

    def run() -> int:
        res = ray.get(worker.generate.remote(prompts, params, 1))
        return sum(len(r.samples[0].token_ids) for r in res)

    def stop() -> None:
        ray.get(worker.shutdown.remote())
        ray.kill(worker)

    return run, stop


def main() -> None:
    import ray

    from otray.models import load_tokenizer, resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,100m")
    ap.add_argument("--backends", default="vllm,hf")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "rollout_throughput.json")
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}})
    rows = []
    for size in args.sizes.split(","):
        path = resolve_model_path("tiny" if size == "tiny" else f"tiny-{size}", ".cache/models")
        prompts = prompts_for(load_tokenizer(path), args.batch)
        for backend in args.backends.split(","):
            result = {"size": size, "backend": backend, "batch": args.batch, "new_tokens": args.tokens}
            modes = ("direct", "worker", "worker_engine_process") if backend == "vllm" else ("direct", "worker")
            for mode in modes:
                if mode == "direct":
                    run, stop = (direct_vllm if backend == "vllm" else direct_hf)(path, prompts, args.tokens)
                else:
                    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"} if mode == "worker_engine_process" else None
                    run, stop = via_worker(path, backend, prompts, args.tokens, cpus, env)
                secs, tokens = timed(run, args.repeats)
                stop()
                result[f"{mode}_tokens_per_s"] = tokens / secs
                result[f"{mode}_tokens"] = tokens
            result["worker_over_direct"] = result["worker_tokens_per_s"] / result["direct_tokens_per_s"]
            if backend == "vllm":
                result["in_process_over_engine_process"] = (result["worker_tokens_per_s"]
                                                            / result["worker_engine_process_tokens_per_s"])
                print(f"{size:>5}  vllm: worker with the engine in its process {result['worker_tokens_per_s']:8.0f} "
                      f"tok/s, with vLLM's engine process {result['worker_engine_process_tokens_per_s']:8.0f} tok/s, "
                      f"ratio {result['in_process_over_engine_process']:.3f}", flush=True)
            rows.append(result)
            print(f"{size:>5} {backend:>5}: direct {result['direct_tokens_per_s']:8.0f} tok/s, worker "
                  f"{result['worker_tokens_per_s']:8.0f} tok/s, ratio {result['worker_over_direct']:.3f}", flush=True)
    winners = {}
    for size in args.sizes.split(","):
        mine = [r for r in rows if r["size"] == size]
        winners[size] = max(mine, key=lambda r: r["worker_tokens_per_s"])["backend"]
        print(f"{size}: fastest backend through the worker: {winners[size]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"rows": rows, "winner_by_size": winners, "target_ratio": 0.9, "cpus": cpus,
           "machine": platform.platform(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"saved {args.out}")
    ray.shutdown()


if __name__ == "__main__":
    main()
