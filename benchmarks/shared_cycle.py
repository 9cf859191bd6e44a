"""Where a shared learner's cycle goes: N users each looping one one-datum step through the service's coalescing.

The workload of ``tinker_shared_passes.py --client service`` (N threads, each a client sending its
forward_backward and optim_step as one pair through a relay actor holding the service's
:class:`~otray.tinker.service.learner_calls.LearnerCalls`, to one
:class:`~otray.tinker.learner.shared_learner.SharedLearner` over Ray), with both actors noting when each part of a
cycle starts (wall clock: they share the machine). Per cycle, in order: the learner call arrives (``in``), its
shared pass runs (``pass``) and its forward and backward end (``passed``), the optimizer steps are answered
(``optim``: gradient norms; in the pass's hop since session 70), the answer leaves (``out``) and reaches the relay
(``answered``), the fused AdamW update behind it ends (``updated``), and the relay
sends the next call once every client is back (``send``). Printed: the median of each gap between consecutive
marks over the middle of the run, its share of the cycle, the cycle, and the compute thread's idle share
(from the update's end, or the answer's when it ends later, to the next pass).

    python benchmarks/shared_cycle.py [--users 8] [--seconds 15]

Writes ``benchmarks/results/shared_cycle.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import RESULTS, save  # noqa: E402
from benchmarks.tinker_shared_passes import TEXT, relay_class  # noqa: E402


def actors() -> tuple[type, type]:
    """The marking learner and relay (classes made here: Ray ships them with the task, by value)."""
    from otray.tinker.learner.shared_learner import SharedLearner

    class Learner(SharedLearner):
        """A SharedLearner noting when a call arrives and leaves and its pass and optimizer answers run."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.marks: list[tuple[str, float]] = []
            forward_many = self.learner.forward_many

            def passed(requests: list[Any]) -> list[Any]:
                out = forward_many(requests)
                self.marks.append(("passed", time.time()))
                return out

            self.learner.forward_many = passed

        async def calls(self, calls: list[Any]) -> list[Any]:
            self.marks.append(("in", time.time()))
            out = await super().calls(calls)
            self.marks.append(("out", time.time()))
            return out

        def _passes(self, works: list[Any]) -> list[Any]:
            self.marks.append(("pass", time.time()))
            return super()._passes(works)

        def _optim_answers(self, works: list[Any]) -> list[Any]:
            self.marks.append(("optim", time.time()))
            out = super()._optim_answers(works)
            self.pool.submit(lambda: self.marks.append(("updated", time.time())))  # queued behind the update
            return out

        def take_marks(self) -> list[tuple[str, float]]:
            return self.marks

    class Relay(relay_class()):
        """The service's relay (``tinker_shared_passes.py --client service``), noting when a coalesced call is sent
        and answered."""

        def __init__(self, learner: Any, small_tokens: int):
            super().__init__(learner, small_tokens)
            self.marks: list[tuple[str, float]] = []
            call = self.calls._call

            async def marked(handle: Any, members: list[Any]) -> None:
                self.marks.append(("send", time.time()))
                await call(handle, members)
                self.marks.append(("answered", time.time()))

            self.calls._call = marked

        def take_marks(self) -> list[tuple[str, float]]:
            return self.marks

    return Learner, Relay


def timeline(marks: list[tuple[str, float]], start: float, end: float) -> dict[str, Any]:
    """The medians of the gaps between consecutive marks (``from->to``) between ``start`` and ``end``, the cycle
    (pass to pass) and the compute thread's idle share (from ``updated``, or ``out`` when later, to ``pass``)."""
    marks = sorted((t, k) for k, t in marks if start <= t <= end)
    gaps: dict[str, list[float]] = {}
    for (ta, a), (tb, b) in zip(marks, marks[1:]):
        gaps.setdefault(f"{a}->{b}", []).append(tb - ta)
    passes = [t for t, k in marks if k == "pass"]
    cycles = [b - a for a, b in zip(passes, passes[1:])]
    idle, free = 0.0, None  # the compute thread is free after the update and the answer, until the next pass
    for t, k in marks:
        if k in ("updated", "out"):
            free = t if free is None else max(free, t)
        elif k == "pass" and free is not None:
            idle, free = idle + t - free, None
    cycle = statistics.median(cycles) if cycles else float("nan")
    common = {k: v for k, v in gaps.items() if len(v) >= len(cycles) / 2}  # the usual order of marks
    return {"cycle_ms": cycle * 1e3, "cycles": len(cycles),
            "gaps_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(common.items(), key=lambda kv: -sum(kv[1]))},
            "compute_idle_share": idle / (passes[-1] - passes[0]) if len(passes) > 1 else None}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15.0, help="the measured window (after 3 s not counted)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "shared_cycle.json"))
    args = ap.parse_args(argv)
    import ray

    from otray.models import load_tokenizer, resolve_model_path
    from otray.tinker.config import TinkerScheduling
    from otray.tinker.learner.calls import PairCall, PassCall
    from otray.tinker.learner.passes import PassRequest
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.types import Datum

    path = resolve_model_path("tiny", ROOT / ".cache" / "models")
    ids = load_tokenizer(path).encode(TEXT)
    n = len(ids) - 1
    data = [Datum(ids[:-1], ids[1:], [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    scheduling = TinkerScheduling()
    learner_cls, relay_cls = actors()
    learner = ray.remote(learner_cls).options(num_cpus=1).remote(
        path, slice_tokens=scheduling.slice_tokens, pass_tokens=scheduling.pass_tokens, num_threads=1)
    ray.get([learner.create.remote(f"u{i}", f"u{i}", AdapterSpec(args.rank, i)) for i in range(args.users)])
    relay = ray.remote(relay_cls).options(num_cpus=0).remote(learner, scheduling.coalesce_tokens)

    def step(user: str) -> None:
        call = PairCall(PassCall(user, PassRequest(user, data, "cross_entropy")), AdamStep(learning_rate=1e-5))
        got = ray.get(relay.train_step.remote(call))
        if isinstance(got.optim_step, BaseException):
            raise got.optim_step

    for i in range(args.users):
        step(f"u{i}")
    stop, done = threading.Event(), [0] * args.users
    start = time.time() + 3.0
    end = start + args.seconds

    def loop(i: int) -> None:
        while not stop.is_set():
            step(f"u{i}")
            done[i] += start <= time.time() < end

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(args.users)]
    for t in threads:
        t.start()
    time.sleep(end - time.time() + 0.5)
    stop.set()
    for t in threads:
        t.join()
    marks = ray.get(learner.take_marks.remote()) + ray.get(relay.take_marks.remote())
    ray.shutdown()
    got = {"users": args.users, "datums_per_s": sum(done) / args.seconds, **timeline(marks, start, end)}
    print(f"N={args.users}: {got['datums_per_s']:.1f} datums/s, a cycle {got['cycle_ms']:.1f} ms (median of "
          f"{got['cycles']}); the compute thread idle {got['compute_idle_share']:.0%}")
    for k, v in got["gaps_ms"].items():
        print(f"  {k:18s} {v:6.2f} ms ({v / got['cycle_ms']:.0%})")
    save({"args": vars(args), "model": path, **got}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
