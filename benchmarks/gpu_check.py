"""The GPU engine's probes, in one process: learner step, sampler, weight sync, precision, on one device.

    python benchmarks/gpu_check.py                         # on a GPU: the 0.5B shape, 64 x (35 + 256) tokens
    python benchmarks/gpu_check.py --device cpu --shape tiny --rows 4 --new 8   # the smoke run of the test suite

Each probe prints a line and the whole is saved as JSON (``--out``, default
``benchmarks/results/gpu_check.json``):

- ``learner``: a full-parameter PolicyLearner in ``model.dtype: auto`` (bf16 compute, float32 master
  weights on a GPU): median seconds of forward_backward + optim_step over ``--repeats`` steps, the
  micro-batch budget it derived (``micro_batch_tokens: 0``), peak device memory;
- ``precision``: one lr-1e-6 step moves the master weights (the fraction of weights that changed);
- ``sampler``: the HF sampler (eager generate, chosen-token logprobs step by step) on ``--rows`` prompts
  x ``--new`` new tokens: seconds, tokens/s, and the sampler/learner logprob gap on what it sampled;
- ``sync``: the learner's weights into the sampler in one process (``weights()`` + ``load_full_weights``):
  seconds and bytes (the Ray transports are measured by ``make gpu-check``'s Ray probe, when Ray is there).

Targets (issue 31) are on one H100 for the 0.5B shape: sampler <= 2 s for 64 x 256 tokens once compiled
(this eager sampler is the baseline the compiled one must beat), weight sync <= 0.05 s between actors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch(tokenizer, rows: int, prompt_len: int, new: int):
    from otray.algos.datums import sft_datum

    prompt = (tokenizer.encode("12+34=" * 64))[:prompt_len]
    answer = (tokenizer.encode("46 " * new))[:new]
    return [sft_datum(prompt, answer) for _ in range(rows)], prompt


def probe(args: argparse.Namespace) -> dict:
    import torch

    from otray.actors.learner.core import trainable
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import load_tokenizer, resolve_model_path
    from otray.types import SamplingParams

    path = resolve_model_path(args.shape if args.shape == "tiny" else f"tiny-{args.shape}", ROOT / ".cache" / "models")
    tok = load_tokenizer(path)
    data, prompt = batch(tok, args.rows, args.prompt, args.new)
    out: dict = {"device": args.device, "shape": args.shape, "rows": args.rows, "prompt": args.prompt, "new": args.new,
                 "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None}

    learner = PolicyLearner(path, device=args.device, dtype="auto", micro_batch_tokens=0, seed=0)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    learner.forward_backward(data, "cross_entropy")
    learner.optim_step(learning_rate=1e-6, grad_clip=None)
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in learner.model.named_parameters())
    out["precision"] = {"storage": learner.precision.storage, "compute": learner.precision.compute,
                        "moved_fraction_at_lr_1e-6": changed / sum(p.numel() for p in trainable(learner.model))}
    del before
    times = []
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        _sync(args.device)
        t0 = time.perf_counter()
        learner.forward_backward(data, "importance_sampling")
        learner.optim_step(learning_rate=1e-6)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    out["learner"] = {"step_s": statistics.median(times), "steps_s": times, "micro_batch_tokens": learner.token_budget(),
                      "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None}
    print(f"learner: {out['learner']['step_s']:.3f} s a step (fwd+bwd+AdamW), budget "
          f"{out['learner']['micro_batch_tokens']} tokens; lr 1e-6 moved "
          f"{out['precision']['moved_fraction_at_lr_1e-6']:.1%} of the weights", flush=True)

    sampler = HFBackend(path, device=args.device, dtype="auto", max_batch=args.rows)
    params = SamplingParams(max_tokens=args.new, temperature=1.0, ignore_eos=True, seed=1)
    sampler.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), 1)  # warm-up
    gen = []
    for _ in range(max(1, args.repeats // 2)):
        _sync(args.device)
        t0 = time.perf_counter()
        samples = sampler.generate([prompt] * args.rows, params, 1)
        _sync(args.device)
        gen.append(time.perf_counter() - t0)
    sampled = sum(len(s[0].token_ids) for s in samples)
    out["sampler"] = {"generate_s": statistics.median(gen), "tokens_per_s": sampled / statistics.median(gen),
                      "sampled_tokens": sampled}

    t0 = time.perf_counter()
    update = learner.weights()
    sampler.load_full_weights(update.tensors)
    _sync(args.device)
    out["sync"] = {"in_process_s": time.perf_counter() - t0,
                   "bytes": sum(t.numel() * t.element_size() for t in update.tensors.values())}
    from otray.algos.datums import sft_datum

    s = sampler.generate([prompt], params, 1)[0][0]  # sampled with the synced weights
    lp = learner.forward([sft_datum(prompt, s.token_ids)])[0][-len(s.token_ids):]
    out["sampler"]["logprob_gap_max"] = max(abs(a - b) for a, b in zip(lp, s.logprobs))
    print(f"sampler: {out['sampler']['generate_s']:.3f} s for {args.rows} x {args.new} tokens "
          f"({out['sampler']['tokens_per_s']:.0f} tok/s), logprob gap {out['sampler']['logprob_gap_max']:.2e} "
          f"(after a sync); sync in process {out['sync']['in_process_s']:.3f} s for "
          f"{out['sync']['bytes'] / 2**20:.0f} MiB", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="0.5b", help="tiny | 100m | 0.5b | 1.5b (otray.models.SHAPES)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=35)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = ap.parse_args(argv)
    result = probe(args)
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
