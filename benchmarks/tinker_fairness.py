"""Fair shares of one learner: a user who saturates it must not slow another user's small step.

Two users of one ``otray tinker`` service (auth on, the tiny model, its learner on one CPU):

- alice: ``--clients`` training clients (rank 32), each in its own thread, stepping in a loop:
  ``forward_backward`` of ``--batch`` datums of ``--tokens`` tokens, then ``optim_step`` (sent
  together, as the SDK pipelines them). Her throughput is datums per second over all clients.
- bob: one client stepping with one datum of about 16 tokens (forward_backward + optim_step), each
  step timed.

For each ``scheduling.policy`` side by side, on a fresh service: ``fifo`` (calls in arrival order,
unsliced: what the service did before) and ``fair`` (:mod:`otray.tinker.learner.fair`), three phases:
bob alone, alice alone, both. Reported: bob's median step with alice saturating / alone (target
<= 2x; it was 257x when found) and alice's throughput with bob stepping / alone (target >= 0.9),
plus what ``fair`` costs alice against ``fifo`` when she is alone (slicing).

    python benchmarks/tinker_fairness.py [--seconds 20] [--slice-tokens 512]

Prints a table and writes ``benchmarks/results/tinker_fairness.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402

PORT = 8495
BASE = "tiny"


def datum(tokens: list[int]) -> Any:
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


class Stepper(threading.Thread):
    """Calls ``step()`` (one training step of a client) until ``stop`` is set, ``pause`` s apart;
    ``steps``: (start, seconds) of each."""

    def __init__(self, step: Callable[[], None], stop: threading.Event, pause: float = 0.0):
        super().__init__(daemon=True)
        self.step, self.stop, self.pause, self.steps = step, stop, pause, []

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.step()
            self.steps.append((t0, time.perf_counter() - t0))
            self.stop.wait(self.pause)


def sdk_step(client: Any, data: list[Any]) -> Callable[[], None]:
    """A tinker SDK client's step: forward_backward and optim_step sent together, then both awaited."""
    from tinker import types

    def step() -> None:
        fb = client.forward_backward(data, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=1e-5))
        fb.result(), opt.result()

    return step


@dataclass(frozen=True)
class Window:
    """A measured window (``time.perf_counter`` seconds): steps are counted between ``start`` and ``end``."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def holds(self, step: tuple[float, float]) -> bool:
        """Whether a step (start, seconds) began and ended in the window."""
        return step[0] >= self.start and step[0] + step[1] <= self.end


def run_window(steppers: list[Stepper], stop: threading.Event, args, timed: Optional[Stepper] = None,
               least: int = 2) -> Window:
    """Run ``steppers`` for ``args.warmup`` s not counted, then a window of ``args.seconds``; then stop them
    (``stop``). With ``timed`` (one of them, whose step times are the figure), the window stays open until it holds
    ``least`` of its steps, up to 20 times ``args.seconds`` (a slow or one-core machine: a CI run saw none
    in 1.5 s); past that a RuntimeError names the stepper and what to raise."""
    for t in steppers:
        t.start()
    start = time.perf_counter() + args.warmup
    time.sleep(args.warmup + args.seconds)
    cap = start + 20 * args.seconds
    while timed is not None and sum(map(Window(start, time.perf_counter()).holds, list(timed.steps))) < least:
        if time.perf_counter() > cap:
            stop.set()
            raise RuntimeError(f"the timed client finished fewer than {least} steps in {20 * args.seconds:.0f} s "
                               "(20x --seconds): raise --seconds")
        time.sleep(0.05)
    end = time.perf_counter()
    stop.set()
    for t in steppers:
        t.join()
    return Window(start, end)


def phase(alice: list[Callable[[], None]], bob: Optional[Callable[[], None]], args, bob_pause: float = 0.0) -> dict[str, Any]:
    """One phase of ``args.seconds`` (after ``args.warmup`` s not counted) with alice's clients' steps and
    bob's (``bob_pause`` s between his; None: bob idle): bob's step times and alice's datums per second."""
    stop = threading.Event()
    alices = [Stepper(step, stop) for step in alice]
    bobs = [Stepper(bob, stop, bob_pause)] if bob is not None else []
    window = run_window(alices + bobs, stop, args, timed=bobs[0] if bobs else None)
    # alice: steps that ended in the window (unbiased for a long window: each client's ends are a renewal
    # process); bob: steps that began and ended in it
    counted = [[s for s in t.steps if window.start <= s[0] + s[1] < window.end] for t in alices]
    out: dict[str, Any] = {"window_s": window.seconds}
    if alices:
        out["alice_datums_per_s"] = sum(len(c) for c in counted) * args.batch / window.seconds
        out["alice_steps"] = sum(len(c) for c in counted)
    if bobs:
        times = [d for s, d in bobs[0].steps if window.holds((s, d))]
        out.update(bob_median_s=statistics.median(times), bob_p90_s=sorted(times)[int(0.9 * (len(times) - 1))],
                   bob_steps=len(times))
    return out


# what steps in a phase: (alice's clients, bob, bob pausing ``--bob-pause`` s between his steps)
KINDS = {"bob_pausing": (False, True, True), "bob": (False, True, False), "alice": (True, False, False),
         "both": (True, True, True), "both_back_to_back": (True, True, False)}
# the usual phases, (name, kind): each figure alone is the mean of a first and a last phase, which bracket the
# phases together (runs drift by ~10% over minutes on a shared machine)
ORDER = (("bob_alone_pausing_first", "bob_pausing"), ("bob_alone", "bob"), ("alice_alone", "alice"),
         ("both", "both"), ("both_bob_back_to_back", "both_back_to_back"), ("alice_alone_after", "alice"),
         ("bob_alone_after", "bob"), ("bob_alone_pausing", "bob_pausing"))


def phases(alice: list[Callable[[], None]], bob: Callable[[], None], args, usage: Callable[[], dict]) -> dict[str, Any]:
    """The phases of :data:`ORDER` (bob alone pausing, bob alone back to back, alice alone, both with bob pausing,
    then back to back, alice alone again, bob alone again, bob alone pausing again), or ``args.phases``' kinds in
    their order (rows named ``<i>_<kind>``); with the learner's use in each (``usage()``: :meth:`SharedLearner.usage`)."""
    order = [(f"{i}_{k}", k) for i, k in enumerate(args.phases.split(","))] if args.phases else ORDER
    rows: dict[str, Any] = {}
    for name, kind in order:
        has_alice, has_bob, pausing = KINDS[kind]
        a, b, pause = alice if has_alice else [], bob if has_bob else None, args.bob_pause if pausing else 0.0
        before = usage()
        t0 = time.perf_counter()
        rows[name] = phase(a, b, args, pause)
        wall = time.perf_counter() - t0
        now = usage()
        spent = {u: s - before["seconds"].get(u, 0.0) for u, s in now["seconds"].items()}
        rows[name].update(learner_busy=sum(spent.values()) / wall, learner_held=(now["held_s"] - before["held_s"]) / wall)
        if b is not None:
            rows[name].update(bob_pause_s=pause, bob_learner_share=spent.get("bob", 0.0) / max(sum(spent.values()), 1e-9))
        if a:  # learner seconds per step of hers: the same unless something else slows the learner (the CPU)
            steps = {u: n - before["steps"].get(u, 0) for u, n in now["steps"].items()}
            rows[name]["alice_learner_s_per_slice"] = spent.get("alice", 0.0) / max(steps.get("alice", 0), 1)
    return rows


def summarize(results: dict[str, Any], args, model: str) -> dict[str, Any]:
    """Ratios per policy (printed), and fair against fifo for alice alone; what is saved. With ``args.phases``: each
    phase's figures and how far apart alice's alone phases are (max / min - 1), no ratios."""
    if args.phases:
        for policy, r in results.items():
            alone = [row["alice_datums_per_s"] for name, row in r.items() if name.endswith("_alice")]
            r["alice_alone_spread"] = max(alone) / min(alone) - 1 if len(alone) > 1 and min(alone) > 0 else None
            for name, row in r.items():
                if isinstance(row, dict):
                    print(f"{policy:5} {name:22} " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                              if k in ("alice_datums_per_s", "bob_median_s",
                                                                       "alice_learner_s_per_slice")), flush=True)
            print(f"{policy:5} alice's alone phases {100 * (r['alice_alone_spread'] or 0):.1f}% apart", flush=True)
        return {"args": vars(args), "model": model, "results": results}
    for policy, r in results.items():
        first, last = r["alice_alone"]["alice_datums_per_s"], r["alice_alone_after"]["alice_datums_per_s"]
        alone = r["alice_alone_datums_per_s"] = (first + last) / 2
        r["alice_alone_drift"] = abs(last - first) / alone  # the bar for a phase long enough: < 5%
        b0, b1 = r["bob_alone"]["bob_median_s"], r["bob_alone_after"]["bob_median_s"]
        bob_alone = r["bob_alone_median_s"] = (b0 + b1) / 2
        r["bob_alone_drift"] = abs(b1 - b0) / bob_alone
        print(f"{policy:5} alone, first and last phase: alice {first:.1f} / {last:.1f} datums/s "
              f"({100 * r['alice_alone_drift']:.1f}% apart), bob {b0:.4f} / {b1:.4f} s "
              f"({100 * r['bob_alone_drift']:.1f}% apart)", flush=True)
        for name in ("both", "both_bob_back_to_back"):
            b = r[name]
            b["bob_slowdown"] = b["bob_median_s"] / bob_alone
            vs_pausing = ""
            if name == "both":  # against bob alone stepping as he does here (pausing: his caches and threads cold)
                p0 = r["bob_alone_pausing_first"]["bob_median_s"]
                p1 = r["bob_alone_pausing"]["bob_median_s"]
                pausing = r["bob_alone_pausing_median_s"] = (p0 + p1) / 2
                r["bob_alone_pausing_drift"] = abs(p1 - p0) / pausing
                b["bob_slowdown_vs_alone_pausing"] = b["bob_median_s"] / pausing
                vs_pausing = (f"; {b['bob_slowdown_vs_alone_pausing']:.2f}x his {pausing:.3f} s alone pausing as here, "
                              f"{p0:.3f} / {p1:.3f} s first and last")
            b["alice_throughput_kept"] = b["alice_datums_per_s"] / alone
            print(f"{policy:5} bob pausing {b['bob_pause_s']:.1f} s: bob alone {bob_alone:.3f} s, "
                  f"with alice {b['bob_median_s']:.3f} s ({b['bob_slowdown']:.2f}x{vs_pausing}); alice alone "
                  f"{alone:.1f} datums/s, with bob {b['alice_datums_per_s']:.1f} "
                  f"({100 * b['alice_throughput_kept']:.0f}%; bob's learner share {100 * b['bob_learner_share']:.0f}%; "
                  f"learner busy {100 * b['learner_busy']:.0f}%, kept for a follower {100 * b['learner_held']:.1f}%)",
                  flush=True)
    out: dict[str, Any] = {"args": vars(args), "model": model, "results": results,
                           "targets": {"bob_slowdown_max": 1.5, "alice_throughput_kept_min": 0.9}}  # issue 53
    if "fair" in results and "fifo" in results:
        out["fair_vs_fifo_alice_alone"] = (results["fair"]["alice_alone_datums_per_s"]
                                           / results["fifo"]["alice_alone_datums_per_s"])
        print(f"fair/fifo, alice alone: {out['fair_vs_fifo_alice_alone']:.2f}")
    return out


def arguments(ap: argparse.ArgumentParser, out: str, argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The workload's command line, shared with benchmarks/learner_fairness.py."""
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="alice's datums per forward_backward")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per datum of alice's")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--slice-tokens", type=int, default=256, help="the fair policy's scheduling.slice_tokens")
    ap.add_argument("--pass-tokens", type=int, default=None,
                    help="the fair policy's scheduling.pass_tokens (default: 1.25 x the slice, as the config's "
                         "default is; 0: no shared passes)")
    ap.add_argument("--policies", default="fifo,fair")
    ap.add_argument("--bob-pause", type=float, default=0.5,
                    help="seconds bob spends between steps (sampling, his env) in the main phase")
    ap.add_argument("--phases", default="",
                    help="phase kinds to run in this order instead of the usual eight, to look into drift (e.g. "
                         f"alice,alice,alice,both,alice; kinds: {', '.join(KINDS)}): each phase's figures, no ratios")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out))
    args = ap.parse_args(argv)
    unknown = [k for k in args.phases.split(",") if k not in KINDS] if args.phases else []
    if unknown:
        ap.error(f"--phases: no phase kind {', '.join(map(repr, unknown))}; the kinds: {', '.join(KINDS)}")
    if args.pass_tokens is None:
        args.pass_tokens = args.slice_tokens * 5 // 4
    return args


def run_policy(policy: str, args, tmp: Path, keys: dict[str, str]) -> dict[str, Any]:
    import ray
    import tinker
    from ray import serve

    from otray.models import load_tokenizer, resolve_model_path
    from otray.tinker.gateway.app import run
    from otray.tinker.config import load_tinker
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    path = resolve_model_path(BASE, ROOT / ".cache" / "models")
    run(load_tinker({"port": PORT, "storage": str(tmp / f"store-{policy}"), "long_poll_s": 5,
                     "scheduling": {"policy": policy, "slice_tokens": args.slice_tokens, "pass_tokens": args.pass_tokens},
                     "models": [{"name": BASE, "path": path, "learner_cpus": 1, "num_threads": 1,
                                 "sampler": {"engine": "learner"}}]}))
    tok = load_tokenizer(path)
    text = tok.encode("the answer is the sum of the number you are a helpful assistant " * 40)
    url = f"http://127.0.0.1:{PORT}"
    service = {"alice": tinker.ServiceClient(base_url=url, api_key=keys["alice"]),
               "bob": tinker.ServiceClient(base_url=url, api_key=keys["bob"]),
               "alice_data": [datum(text[i:i + args.tokens + 1]) for i in range(args.batch)],
               "bob_data": [datum(tok.encode("12 plus 30 is 42, so the answer is 42."))]}
    service["alice_clients"] = [service["alice"].create_lora_training_client(base_model=BASE, rank=32).result()
                                for _ in range(args.clients)]
    service["bob_client"] = service["bob"].create_lora_training_client(base_model=BASE, rank=32).result()
    actor = ray.get_actor(NAME, namespace=NAMESPACE)
    rows = phases([sdk_step(c, service["alice_data"]) for c in service["alice_clients"]],
                  sdk_step(service["bob_client"], service["bob_data"]), args,
                  lambda: ray.get(actor.learner_use.remote())[BASE])
    for who in ("alice", "bob"):
        service[who].close("success").result()
    serve.shutdown()
    ray.kill(actor)
    ray.kill(ray.get_actor(f"{NAME}-learner-{BASE}", namespace=NAMESPACE))
    return rows


def main() -> None:
    args = arguments(argparse.ArgumentParser(), "tinker_fairness.json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from otray.actors.control.registry import tinker_key
    from otray.actors.control.resource_manager import get_or_create

    tmp = Path(tempfile.mkdtemp(prefix="otray-fairness-"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rm = get_or_create(str(tmp / "registry.db"), auth_enabled=True)
    alice = ray.get(rm.add_user.remote("alice"))
    keys = {"alice": tinker_key(alice), "bob": tinker_key(ray.get(rm.add_user.remote("bob", False, alice)))}
    results = {policy: run_policy(policy, args, tmp, keys) for policy in args.policies.split(",")}
    save({**summarize(results, args, BASE), "learner_threads": 1, "through": "the tinker SDK over HTTP"}, args.out)
    ray.shutdown()


if __name__ == "__main__":
    main()
