"""Fair shares of one learner, measured on the learner actor itself.

The workload of ``benchmarks/tinker_fairness.py`` (alice: ``--clients`` clients stepping with
``--batch`` datums of ``--tokens`` tokens; bob: one client stepping with one ~16-token datum), with
the calls made straight to a :class:`~otray.tinker.learner.shared_learner.SharedLearner` over Ray: no HTTP,
no SDK, no service, so what is measured is the learner and its fair queue (on 2 CPU cores the SDK
run also measures the HTTP traffic competing with the learner for the CPU). As the service does,
a client sends its optim_step once its forward_backward is done. fifo and fair side by side.

Runs on the CPU (the tiny model, one torch thread) and on a GPU (``--gpu``, e.g. ``--shape 0.5b``:
part of ``make gpu-check``; it needs Ray, no vLLM or SDK).

    python benchmarks/learner_fairness.py [--shape tiny] [--gpu] [--slice-tokens 256] [--wait-for-followers]
        [--policies fifo,fair,fair-side] [--side-tokens 64] [--alice sample]

``--alice sample``: alice's clients sample on the learner instead (each loops one sampling call of the base model:
``--batch`` samples of ``--tokens`` tokens, end-of-sequence ignored; her "datums" are samples): under ``fair`` a
call is decoded in turns of ``--sample-turn-ms`` (:class:`~otray.tinker.learner.learner_sampling.SampleRun`),
under ``fifo`` whole.

``fair-side``: the fair policy with the side lane (``scheduling.side_tokens``, :mod:`otray.tinker.learner.fair`):
bob's one-datum steps on a second compute thread beside alice's passes (the learner given two CPUs, one torch
thread each); its "learner busy" can pass 100% (two lanes).

Prints a table and writes ``benchmarks/results/learner_fairness.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402
from benchmarks.tinker_fairness import arguments, phases, summarize  # noqa: E402


def client_step(learner: Any, user: str, adapter: str, data: list) -> Callable[[], None]:
    import ray

    from otray.tinker.learner.specs import AdamStep

    def step() -> None:
        ray.get(learner.forward_backward.remote(user, adapter, data, "cross_entropy"))
        ray.get(learner.optim_step.remote(user, adapter, AdamStep(learning_rate=1e-5)))

    return step


def sample_step(learner: Any, user: str, prompt: list[int], args) -> Callable[[], None]:
    import ray

    from otray.tinker.learner.sample_jobs import SampleJob
    from otray.types import SamplingParams

    job = SampleJob(None, [prompt], SamplingParams(max_tokens=args.tokens, ignore_eos=True), args.batch)

    def step() -> None:
        ray.get(learner.sample.remote([job], user))

    return step


def run_policy(policy: str, args, path: str) -> dict[str, Any]:
    import ray

    from otray.models import load_tokenizer
    from otray.tinker.learner.specs import AdapterSpec
    from otray.tinker.learner.shared_learner import SharedLearner
    from otray.types import Datum

    def datum(tokens: list[int]) -> Datum:
        n = len(tokens) - 1
        return Datum(tokens[:-1], tokens[1:], [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)

    side = args.side_tokens if policy == "fair-side" else 0  # fair with the side lane, on a second core
    learner = ray.remote(SharedLearner).options(num_cpus=2 if side else 1, num_gpus=1 if args.gpu else 0).remote(
        path, policy="fair" if side else policy, slice_tokens=args.slice_tokens, pass_tokens=args.pass_tokens,
        wait_for_followers=args.wait_for_followers, num_threads=None if args.gpu else 1, side_tokens=side,
        sample_turn_s=args.sample_turn_ms / 1000)
    ray.get(learner.ping.remote())
    tok = load_tokenizer(path)
    text = tok.encode("the answer is the sum of the number you are a helpful assistant " * 40)
    alice_data = [datum(text[i:i + args.tokens + 1]) for i in range(args.batch)]
    bob_data = [datum(tok.encode("12 plus 30 is 42, so the answer is 42."))]
    if args.alice == "sample":
        alice = [sample_step(learner, "alice", text[:16], args) for _ in range(args.clients)]
    else:
        for i in range(args.clients):
            ray.get(learner.create.remote("alice", f"a{i}", AdapterSpec(32, i)))
        alice = [client_step(learner, "alice", f"a{i}", alice_data) for i in range(args.clients)]
    ray.get(learner.create.remote("bob", "b", AdapterSpec(32, 99)))
    rows = phases(alice,
                  client_step(learner, "bob", "b", bob_data), args, lambda: ray.get(learner.usage.remote()))
    ray.kill(learner)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", help="a tiny model shape: tiny, 100m, 0.5b, 1.5b")
    ap.add_argument("--gpu", action="store_true", help="the learner on a GPU")
    ap.add_argument("--wait-for-followers", action="store_true",
                    help="the fair policy's scheduling.wait_for_followers (off by default, as in the config)")
    ap.add_argument("--side-tokens", type=int, default=64,
                    help="the policy fair-side's scheduling.side_tokens: fair, with small steps on a second compute "
                         "thread beside a pass (e.g. --policies fair,fair-side)")
    ap.add_argument("--alice", choices=("train", "sample"), default="train",
                    help="what alice's clients do on the learner: training steps, or sampling calls of the base model")
    ap.add_argument("--sample-turn-ms", type=float, default=50.0,
                    help="the fair policies' scheduling.sample_turn_ms (0: sampling calls whole)")
    args = arguments(ap, "learner_fairness.json", argv)
    if args.wait_for_followers and (args.pass_tokens <= 0 or args.policies != "fair"):
        ap.error("--wait-for-followers needs shared passes (--pass-tokens > 0) and --policies fair")
    import ray

    from otray.models import resolve_model_path

    path = resolve_model_path("tiny" if args.shape == "tiny" else f"tiny-{args.shape}", ROOT / ".cache" / "models")
    own = not ray.is_initialized()  # (a test calls this in a process whose Ray is already up)
    if own:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = {policy: run_policy(policy, args, path) for policy in args.policies.split(",")}
    save({**summarize(results, args, f"tiny-{args.shape}"), "through": "Ray calls to the SharedLearner"}, args.out)
    if own:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
