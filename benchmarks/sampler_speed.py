"""The HF backend's samplers side by side: ``rollout.sampler: eager`` against ``compiled``, same model, same rows.

    python benchmarks/sampler_speed.py --device cpu --shape 100m --rows 8 --new 64     # this machine
    python benchmarks/sampler_speed.py --device cuda --shape 0.5b_32k --rows 64 --new 256   # a GPU (issue 51)

Both backends load the same model (float32 on the CPU, bf16 on a GPU); every round samples ``--rows`` rows of
exactly ``--new`` tokens (``ignore_eos``) from each, rotating which goes first; the compiled one's warm-up
(compiling and capturing every bucket, paid once when a worker starts) is reported apart. Greedy tokens of
the two are compared once. Prints the medians and saves ``benchmarks/results/sampler_speed_<device>.json``.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", default="100m")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import torch

    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import resolve_model_path
    from otray.types import SamplingParams

    torch.set_num_threads(a.threads)
    path = resolve_model_path("tiny" if a.shape == "tiny" else f"tiny-{a.shape}", ROOT / ".cache" / "models")
    common = {"device": a.device, "dtype": "auto", "max_model_len": 64 + a.new, "max_batch": a.rows}
    eager = HFBackend(path, sampler="eager", **common)
    t0 = time.perf_counter()
    compiled = HFBackend(path, sampler="compiled", **common)
    start_s = time.perf_counter() - t0
    prompt = eager.tokenizer.encode("What is 12 + 34? The answer is")
    prompts = [prompt[: 8 + i % 8] for i in range(a.rows)]
    params = SamplingParams(max_tokens=a.new, temperature=1.0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=min(a.new, 32), temperature=0.0)
    same = [r[0].token_ids for r in eager.generate(prompts, greedy, 1)] == \
        [r[0].token_ids for r in compiled.generate(prompts, greedy, 1)]
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(a.rounds + 1):  # round 0 warms both up (the eager one's packed weights, caches)
        for name in (["eager", "compiled"] if r % 2 else ["compiled", "eager"]):
            backend = eager if name == "eager" else compiled
            t = time.perf_counter()
            out = backend.generate(prompts, params, 1)
            if a.device == "cuda":
                torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - t)
            assert all(len(s[0].token_ids) == a.new for s in out)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "shape": a.shape,
              "rows": a.rows, "new_tokens": a.new, "threads": a.threads, "median_s": med, "times_s": times,
              "compiled_over_eager": med["compiled"] / med["eager"], "compile_s": compiled.compile_s,
              "compiled_start_s": start_s, "greedy_tokens_equal": same,
              "tokens_per_s": {k: a.rows * a.new / v for k, v in med.items()}}
    print(f"{result['device']}, {a.shape}, {a.rows} x {a.new} tokens: eager {med['eager']:.3f} s, compiled "
          f"{med['compiled']:.3f} s ({result['compiled_over_eager']:.2f}); warm-up {compiled.compile_s:.1f} s; "
          f"greedy tokens equal: {same}")
    save(result, a.out or ROOT / "benchmarks" / "results" / f"sampler_speed_{a.device}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
