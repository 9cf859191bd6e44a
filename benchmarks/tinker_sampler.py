"""Who should sample for the Tinker service: the learner's HF ``generate`` or a vLLM engine with the
clients' sampler weights as LoRA adapters. The same RL steps through the ``tinker`` SDK against two
fresh services, one after the other, differing only in ``models[].sampler.engine``.

Model: the ~100M generated model (``tiny-100m``), a rank-32 LoRA on attention and MLP
(``train_unembed=False``: vLLM has no LoRA on the unembedding), 2 torch threads in the learner and
in the vLLM actor. Each RL step (benchmarks/tinker_api.py's): ephemeral sampler weights saved,
``--prompts`` x ``--group`` samples of ``--max-tokens`` tokens (``rl_sampling``, which includes the
engine loading the new adapter), then ``forward_backward`` (importance_sampling) + ``optim_step``
(``rl``: the whole step). Timed after one warm-up step; the vLLM engine's start is in the warm-up.

    python benchmarks/tinker_sampler.py [--steps 3] [--prompts 8] [--group 4] [--max-tokens 16] [--gpu]

Prints a table and writes ``benchmarks/results/tinker_sampler.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tinker_api import through_sdk, workload  # noqa: E402


def main() -> None:
    args, path, pairs, prompts = workload("tinker_sampler", lambda ap: ap.add_argument(
        "--gpu", action="store_true", help="learner and vLLM sampler on one GPU, half each"))
    runs = {engine: through_sdk(path, args, pairs, prompts, engine=engine, train_unembed=False, gpu=args.gpu)
            for engine in ("learner", "vllm")}
    rows = {}
    print(f"{'step':12} {'learner (HF) s':>15} {'vLLM s':>8} {'vLLM / HF':>10}")
    for kind in ("rl_sampling", "rl"):
        hf, vl = statistics.median(runs["learner"][kind][1:]), statistics.median(runs["vllm"][kind][1:])
        rows[kind] = {"learner_s": hf, "vllm_s": vl, "ratio": vl / hf,
                      "learner_all_s": runs["learner"][kind], "vllm_all_s": runs["vllm"][kind]}
        print(f"{kind:12} {hf:15.3f} {vl:8.3f} {vl / hf:10.2f}")
    engines = {e: runs[e]["prompts_by_engine"] for e in runs}
    print(f"prompts sampled by each engine: {engines}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "model": f"tiny-{args.shape}",
                                          "prompts_by_engine": engines, "results": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
