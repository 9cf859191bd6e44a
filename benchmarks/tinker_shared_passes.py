"""Many users' one-datum steps on one Tinker learner: shared passes against a pass per user.

``throughput``: N = 1, 2, 4, 8, 16 users, each a thread looping one ~16-token datum's forward_backward then
optim_step (``--client``: ``sequential``, the first's result awaited before the second is sent; ``pipelined``,
both sent together as the tinker SDK's clients send them; ``ahead``, the next step sent before this one is
awaited, as tinker-cookbook's supervised loop does; ``fused``, both in one call, ``SharedLearner.train_step``, as
the service sends a forward_backward whose optim_step is queued behind it; ``fused-ahead``, fused, the next step
sent before this one is awaited; ``service``, fused, through a relay actor that sends a client's calls one at a time
in order and coalesces small calls of several clients into one learner call as the TinkerService does,
:mod:`otray.tinker.service.learner_calls`; ``service-ahead``, service, the next step sent before this one is
awaited, so the relay has it when this one's answer comes), straight to a
:class:`~otray.tinker.learner.shared_learner.SharedLearner` over Ray (no HTTP: the
learner and its queue are what is measured). Three learners side by side, runs rotating: ``own``
(``pass_tokens=0``: every user's slice a pass of its own, the behaviour before shared passes), ``shared``
(the default ``scheduling.pass_tokens``: queued slices of several users in one pass, each row through its own
adapter) and ``followers`` (shared, with ``scheduling.wait_for_followers``: optimizer steps first and a shared
call waiting for its clients' next jobs). Reported: aggregate datums/s per N and mode, each over own, and the
steps a call holds by kind (forward_backward passes, optimizer steps).

``tenant``: through the official SDK against ``otray tinker`` (auth on) with the base already warm: the
seconds from ``create_lora_training_client`` returning to its first ``forward_backward`` result, for a few
new tenants.

``sdk``: the whole path, through the SDK over HTTP: ``--sdk-users`` clients looping one-datum steps on a service
that coalesces small calls (the default) and on one that does not, alternating ``--sdk-rounds`` times.

``kernels``: in-process (no Ray, no queue), one user's step against N users' shared step: the operators that
compute (kernel launches on a GPU, where a small pass is launch-bound; counted alike on the CPU) and seconds.

    python benchmarks/tinker_shared_passes.py [--shape tiny] [--gpu] [--seconds 20] [--parts throughput,tenant,kernels,sdk] [--rank 32]

Prints the figures and writes ``benchmarks/results/tinker_shared_passes.json`` (``--gpu``: part of
``make gpu-check-tinker``, throughput and kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import save  # noqa: E402
from benchmarks.tinker_fairness import Stepper, run_window  # noqa: E402

USERS = (1, 2, 4, 8, 16)
PORT = 8497
TEXT = "12 plus 30 is 42, so the answer is 42."


def per_key(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, float]:
    """Steps per packable call by pack key (forward_backward passes, optimizer steps) between two usages."""
    out = {}
    for key, now in after.items():
        calls = now["calls"] - before.get(key, {}).get("calls", 0)
        if calls:
            out[key] = (now["steps"] - before.get(key, {}).get("steps", 0)) / calls
    return out


def relay_class() -> type:
    """The relay actor's class for ``--client service`` (made in a function, so Ray ships it by value)."""

    class Relay:
        """A training client's pair on its way to the learner as the TinkerService sends it: a client's calls handed
        over in order, the next while up to ``ahead`` - 1 before it are unanswered (the service's ``OrderedExecutor``
        and ``Handover``, ``scheduling.calls_ahead``; 1: the next when the last is answered, as before session 72),
        through :class:`~otray.tinker.service.learner_calls.LearnerCalls` (small calls of several clients as one
        learner call)."""

        def __init__(self, learner: Any, small_tokens: int, ahead: int):
            from otray.tinker.service.learner_calls import LearnerCalls

            self.learner, self.calls, self.ahead = learner, LearnerCalls(small_tokens), ahead
            self.room: dict[tuple[str, str], Any] = {}  # client -> its semaphore (asyncio's: first come, first served)

        async def train_step(self, call: Any) -> Any:
            import asyncio

            async with self.room.setdefault(call.client(), asyncio.Semaphore(self.ahead)):
                return await self.calls.submit(call, lambda: self.learner)

    return Relay


def learner_rates(args, path: str, done_row: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Aggregate datums/s of N users' one-datum steps, per N (``args.users``), on a learner with and without
    shared passes; ``done_row(rows)`` after each N (the script saves what it has: a time cap keeps it)."""
    import ray

    from otray.models import load_tokenizer
    from otray.tinker.config import TinkerScheduling
    from otray.tinker.learner.calls import PairCall, PassCall
    from otray.tinker.learner.passes import PassRequest
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.tinker.learner.shared_learner import SharedLearner
    from otray.types import Datum

    ids = load_tokenizer(path).encode(TEXT)
    n = len(ids) - 1
    data = [Datum(ids[:-1], ids[1:], [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)]
    passes = TinkerScheduling().pass_tokens
    # mode -> (pass_tokens, wait_for_followers, side_tokens, CPUs: torch threads, or one a lane with the side lane)
    known = {"own": (0, False, 0, 1), "own2": (0, False, 0, 2), "shared": (passes, False, 0, 1),
             "shared2": (passes, False, 0, 2), "shared_alone": (passes, False, 0, 1),
             "followers": (passes, True, 0, 1), "side": (passes, False, 64, 2), "inline": (passes, False, 0, 1),
             "graphs": (passes, False, 0, 1),  # graphs: models[i].graph_passes (bucketed; CUDA graphs on a GPU)
             "own_kept": (0, False, 0, 1),  # own, turns kept among users looping alike (before session 69)
             "pairs_apart": (passes, False, 0, 1),  # shared, a train_step's two parts two turns (before session 70)
             "own_apart": (0, False, 0, 1),  # own, a train_step's two parts two turns (before session 70)
             "shared_one": (passes, False, 0, 1)}  # shared, --client service*: a client's next call sent when its
    # last is answered (before session 72; the others: while it is on the learner, scheduling.calls_ahead)
    modes = {m: known[m] for m in args.modes.split(",")}
    # --client service: the calls each mode's service would coalesce (own: none, as before shared passes)
    coalesce = {m: 0 if m.startswith("own") or m == "shared_alone" else TinkerScheduling().coalesce_tokens for m in modes}

    Relay = relay_class()

    class InlineUpdates(SharedLearner):
        """``inline``: shared passes with each optimizer step's update run before its answer (before session 57)."""

        def _optim_answers(self, works):
            return self.learner.optim_many(works)

    class TurnsKeptAmongAlike(SharedLearner):
        """``own_kept``: a pass per user, with a looping user's turn kept across its round trip while owed it
        even among users who loop alike (before session 69: :mod:`otray.tinker.learner.kept_turns`)."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.queue.turns.alike = lambda name: False

    class PairsApart(SharedLearner):
        """``pairs_apart``: a train_step's forward_backward and optim_step two turns of the queue and two hops of
        the compute thread (before session 70)."""

        pair_turns = False

    users_list = [int(u) for u in args.users.split(",")]
    t0 = time.perf_counter()
    learners = {}
    for mode, (pass_tokens, wait, side, cpus) in modes.items():
        kind = {"inline": InlineUpdates, "own_kept": TurnsKeptAmongAlike, "pairs_apart": PairsApart,
                "own_apart": PairsApart}.get(mode, SharedLearner)
        learners[mode] = ray.remote(kind).options(num_cpus=cpus, num_gpus=0.3 if args.gpu else 0).remote(
            path, slice_tokens=TinkerScheduling().slice_tokens, pass_tokens=pass_tokens, wait_for_followers=wait,
            side_tokens=side, num_threads=None if args.gpu else (1 if side else cpus), graph_passes=mode == "graphs")
        ray.get([learners[mode].create.remote(f"u{i}", f"u{i}", AdapterSpec(args.rank, i))
                 for i in range(max(users_list))])
    relays = {mode: ray.remote(Relay).options(num_cpus=0).remote(learners[mode], coalesce[mode],
                                                                  1 if mode == "shared_one" else TinkerScheduling().calls_ahead)
              for mode in modes} \
        if args.client.startswith("service") else {}

    mode_of = {learner: mode for mode, learner in learners.items()}

    def step(learner: Any, user: str, client: str = "sequential"):
        pending: list[Any] = []  # ``ahead``: the steps sent and not yet awaited

        def go() -> None:
            if client == "ahead":  # the tinker cookbook's supervised loop (submit_ahead=1): the next step is sent
                pending.append([learner.forward_backward.remote(user, user, data, "cross_entropy"),  # before
                                learner.optim_step.remote(user, user, AdamStep(learning_rate=1e-5))])  # this one's
                if len(pending) > 1:  # results are awaited, so the learner has it queued meanwhile
                    ray.get(pending.pop(0))
                return
            if client in ("service", "service-ahead"):  # as fused, through the service's coalescing (Relay);
                # service-ahead: the next step sent before this one is awaited
                call = PairCall(PassCall(user, PassRequest(user, data, "cross_entropy")), AdamStep(learning_rate=1e-5))
                pending.append(relays[mode_of[learner]].train_step.remote(call))
                if len(pending) > (client == "service-ahead"):
                    got = ray.get(pending.pop(0))
                    if isinstance(got.optim_step, BaseException):
                        raise got.optim_step
                return
            if client in ("fused", "fused-ahead"):  # both parts in one call (SharedLearner.train_step), as the
                # service sends them; fused-ahead: the next step sent before this one is awaited
                pending.append(learner.train_step.remote(user, user, data, "cross_entropy",
                                                         AdamStep(learning_rate=1e-5)))
                if len(pending) > (client == "fused-ahead"):
                    got = ray.get(pending.pop(0))
                    if isinstance(got.optim_step, BaseException):
                        raise got.optim_step
                return
            if client == "pipelined":  # as the tinker SDK's clients send a step: both calls, then both results
                ray.get([learner.forward_backward.remote(user, user, data, "cross_entropy"),
                         learner.optim_step.remote(user, user, AdamStep(learning_rate=1e-5))])
                return
            ray.get(learner.forward_backward.remote(user, user, data, "cross_entropy"))
            ray.get(learner.optim_step.remote(user, user, AdamStep(learning_rate=1e-5)))
        return go

    # every adapter steps once first (on a GPU a cold learner's first steps took > 3 s: none finished in the
    # first measured window of session 35's run, which began at N = 8)
    for learner in learners.values():
        for i in range(max(users_list)):
            step(learner, f"u{i}")()
    print(f"{len(learners)} learners with {max(users_list)} adapters each, every adapter stepped once: "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    rows: dict[str, Any] = {}
    for k, users in enumerate(users_list):
        row = {}
        for mode in list(modes)[k % len(modes):] + list(modes)[:k % len(modes)]:  # rotating: drift hits all
            learner = learners[mode]
            usage = ray.get(learner.usage.remote())
            stop = threading.Event()
            threads = [Stepper(step(learner, f"u{i}", args.client), stop) for i in range(users)]
            window = run_window(threads, stop, args)
            done = sum(1 for t in threads for s in t.steps if window.start <= s[0] + s[1] < window.end)
            after = ray.get(learner.usage.remote())
            before, now = usage["shared"], after["shared"]
            calls = now["calls"] - before["calls"]
            batched = {k: after["batched"][k] - usage["batched"][k] for k in ("calls", "members")}
            row[mode] = {"datums_per_s": done / window.seconds,  # shared calls: forward_backward passes and optim steps
                         "mean_steps_per_shared_call": (now["steps"] - before["steps"]) / calls if calls else 1.0,
                         "steps_per_call_by_key": per_key(usage["packed"], after["packed"]),
                         "requests_per_learner_call": batched["members"] / batched["calls"] if batched["calls"] else None,
                         # the learner idle, waiting for riders or a held turn's next job (FairQueue: Followers.held)
                         "learner_waiting_share": (after["held_s"] - usage["held_s"]) / window.seconds}
        own = row["own"]["datums_per_s"]
        others = [m for m in modes if m != "own"]
        for mode in others:  # None: no own step ended
            row[f"{mode}_over_own"] = row[mode]["datums_per_s"] / own if own else None
            if "own2" in row and mode != "own2":  # against a pass per user on as many cores
                row[f"{mode}_over_own2"] = row[mode]["datums_per_s"] / row["own2"]["datums_per_s"] or None
        line = "; ".join(f"{m} {row[m]['datums_per_s']:.1f} ({row[f'{m}_over_own'] or float('nan'):.2f}x; a call holds "
                         + ", ".join(f"{k} {v:.1f}" for k, v in row[m]["steps_per_call_by_key"].items()) + ")"
                         for m in others)
        idle = row["own"]["learner_waiting_share"]  # a baseline that idles flatters every ratio (session 69)
        print(f"N={users:2}: own {own:.1f} datums/s (its learner kept waiting {idle:.0%}"
              + (": a ratio against it is too kind" if idle > 0.05 else "") + f"); {line}", flush=True)
        rows[str(users) if str(users) not in rows else f"{users}#{k}"] = row  # (an N again: another rotation)
        done_row(rows)
    if len(users_list) > len(set(users_list)):  # an N measured in several rotations: its ratios' spread
        rows["over_own_by_n"] = spread(rows, [m for m in modes if m != "own"])
        done_row(rows)
    for actor in [*learners.values(), *relays.values()]:
        ray.kill(actor)
    return rows


def spread(rows: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    """Per N and mode: the median, least and greatest of its ratios to own over the rotations that measured it,
    the pooled ratio (its datums over own's, all rotations' windows together) and its median datums/s, with own's
    median datums/s (``own_datums_per_s_median``) (printed too): the machine drifts by 20-40% within minutes, so
    one rotation's ratio is one draw."""
    ratios: dict[str, dict[str, list[float]]] = {}
    pooled: dict[str, dict[str, list[float]]] = {}  # N -> mode -> [its datums/s, own's], summed over rotations
    rates: dict[str, dict[str, list[float]]] = {}  # N -> mode (own too) -> its datums/s, one a rotation
    for key, row in rows.items():
        for mode in modes:
            if row.get(f"{mode}_over_own") is not None:
                n = key.split("#")[0]
                ratios.setdefault(n, {}).setdefault(mode, []).append(row[f"{mode}_over_own"])
                total = pooled.setdefault(n, {}).setdefault(mode, [0.0, 0.0])
                total[0] += row[mode]["datums_per_s"]
                total[1] += row["own"]["datums_per_s"]
        if "own" in row:
            for mode in ("own", *modes):
                rates.setdefault(key.split("#")[0], {}).setdefault(mode, []).append(row[mode]["datums_per_s"])
    out: dict[str, Any] = {}
    for n, by_mode in ratios.items():
        out[n] = {m: {"median": statistics.median(v), "min": min(v), "max": max(v), "rotations": len(v),
                      "pooled": pooled[n][m][0] / pooled[n][m][1],
                      "datums_per_s_median": statistics.median(rates[n][m])} for m, v in by_mode.items()}
        # the machine's phase moves the ratio (a slow phase raises it: NOTES "Issue 53"), so the rates go beside it
        out[n]["own_datums_per_s_median"] = statistics.median(rates[n]["own"])
        print(f"N={n:>2} over {len(next(iter(by_mode.values())))} rotations: " + "; ".join(
            f"{m} {r['median']:.2f}x median ({r['min']:.2f}-{r['max']:.2f}), {r['pooled']:.2f}x pooled, "
            f"{r['datums_per_s_median']:.1f} datums/s" for m, r in out[n].items() if isinstance(r, dict))
              + f"; own {out[n]['own_datums_per_s_median']:.1f} datums/s (medians)", flush=True)
    return out


def kernels(args, path: str) -> dict[str, Any]:
    """In-process, no Ray or queue: one user's step (one ~16-token datum's forward_backward and optim_step, as a
    learner without shared passes runs them: a pass and an optimizer call of its own) against
    N users' shared step (one forward_many + one optim_many), per N: the operators that compute
    (:class:`~benchmarks.op_count.ComputeOps`: kernel launches on a GPU) and the median seconds (device synced)."""
    import torch

    from benchmarks.op_count import ComputeOps
    from otray.models import load_tokenizer
    from otray.tinker.learner.adapter_learner import AdapterLearner
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.tinker.learner.passes import PassRequest
    from otray.types import Datum

    ids = load_tokenizer(path).encode(TEXT)
    n = len(ids) - 1
    data = [Datum(ids[:-1], ids[1:], [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)]
    # on the CPU one torch thread, as the throughput part's learners (torch's default, every core, made the
    # in-process shared step 1.2x faster than those learners' and the in-process ratio not theirs: session 64)
    learner = AdapterLearner(path, device="auto" if args.gpu else "cpu", num_threads=None if args.gpu else 1)
    sync = torch.cuda.synchronize if learner.device.startswith("cuda") else (lambda: None)
    adam = AdamStep(learning_rate=1e-5)
    users = max(int(u) for u in args.users.split(","))
    names = [f"u{i}" for i in range(users)]
    for i, name in enumerate(names):
        learner.create(name, AdapterSpec(args.rank, i))

    def one() -> None:  # as the ``own`` learner runs a user's step (AdapterLearner.forward_backward, the path
        # of a learner without shared passes before them, took 13.6 ms against 10.2 here: session 64)
        learner.forward_many([PassRequest("u0", data, "cross_entropy")])
        learner.optim_many([("u0", adam)])

    def shared(k: int) -> Callable[[], None]:
        def go() -> None:
            learner.forward_many([PassRequest(name, data, "cross_entropy") for name in names[:k]])
            learner.optim_many([(name, adam) for name in names[:k]])
        return go

    def measure(fn: Callable[[], None]) -> dict[str, float]:
        fn()
        fn()  # every adapter's optimizer made and warm
        with ComputeOps() as ops:
            fn()
        times = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return {"ops": ops.count, "median_s": statistics.median(times)}

    base = measure(one)
    rows: dict[str, Any] = {"one_user": base}
    ks = sorted({int(u) for u in args.users.split(",")} - {1})
    for k in ks:
        got = measure(shared(k))
        got["ops_in_users"] = got["ops"] / base["ops"]  # how many one-user steps' operators the shared step has
        got["speed_over_own"] = k * base["median_s"] / got["median_s"]
        rows[str(k)] = got
        print(f"in-process N={k:2}: a shared step computes {got['ops']} operators = {got['ops_in_users']:.2f} one-user "
              f"steps ({base['ops']}); {got['median_s'] * 1e3:.1f} ms against {k} x {base['median_s'] * 1e3:.1f}: "
              f"{got['speed_over_own']:.2f}x", flush=True)
    # the same shared steps as bucketed passes (models[i].graph_passes: CUDA graphs on a GPU, eager on the CPU),
    # the routed ones measured again beside them (the machine drifts)
    for k in ks:
        learner.graph_passes, learner.graphs = False, None
        routed = measure(shared(k))
        learner.graph_passes = True
        got = measure(shared(k))
        graphs = learner.graphs
        got.update(routed_s=routed["median_s"], over_routed=routed["median_s"] / got["median_s"],
                   speed_over_own=k * base["median_s"] / got["median_s"], counts=dict(graphs.counts),
                   failures=[f"{key.rows}x{key.width}: {why}" for key, why in graphs.failures.items()])
        rows[f"graphs_{k}"] = got
        print(f"in-process N={k:2}, bucketed{' (CUDA graphs)' if graphs.capture else ''}: {got['ops']} operators, "
              f"{got['median_s'] * 1e3:.1f} ms against {routed['median_s'] * 1e3:.1f} routed: "
              f"{got['over_routed']:.2f}x; {got['speed_over_own']:.2f}x own; {graphs.counts}"
              + (f"; capture failed: {got['failures']}" if got["failures"] else ""), flush=True)
    return rows


_KEYS: dict[str, str] = {}


def alice_key(tmp: Path) -> str:
    """The API key of user alice on this cluster's ResourceManager (auth on), made by the first part that asks
    (a registry under ``tmp``); later parts reuse it: the manager then asks for an admin's key to add users."""
    import ray

    from otray.actors.control.registry import tinker_key
    from otray.actors.control.resource_manager import get_or_create

    if "alice" not in _KEYS:
        rm = get_or_create(str(tmp / "registry.db"), auth_enabled=True)
        _KEYS["alice"] = tinker_key(ray.get(rm.add_user.remote("alice")))
    return _KEYS["alice"]


def tenant_start(args, path: str) -> dict[str, Any]:
    """Seconds from a new tenant's create_lora_training_client returning to its first forward_backward's
    result, on a service whose base model is warm (another client stepped on it first)."""
    import ray
    import tinker
    from tinker import types

    from benchmarks.tinker_fairness import datum
    from otray.models import load_tokenizer
    from otray.tinker.config import load_tinker
    from otray.tinker.gateway.app import run

    tmp = Path(tempfile.mkdtemp(prefix="otray-tenants-"))
    key = alice_key(tmp)
    run(load_tinker({"port": PORT, "storage": str(tmp / "store"), "models": [
        {"name": "tiny", "path": path, "learner_cpus": 1, "num_threads": 1, "sampler": {"engine": "learner"}}]}))
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{PORT}", api_key=key)
    data = [datum(load_tokenizer(path).encode(TEXT))]
    warm = service.create_lora_training_client(base_model="tiny", rank=32).result()
    warm.forward_backward(data, "cross_entropy").result()
    times, creates = [], []
    for _ in range(args.tenants):
        t0 = time.perf_counter()  # the SDK (since 0.38) returns a future of the client: its result is "returning"
        client = service.create_lora_training_client(base_model="tiny", rank=32).result()
        t1 = time.perf_counter()
        client.forward_backward(data, "cross_entropy").result()
        times.append(time.perf_counter() - t1)
        creates.append(t1 - t0)
        client.optim_step(types.AdamParams(learning_rate=1e-5)).result()
    service.close("success").result()
    end_service()
    out = {"first_forward_backward_s": times, "median_s": statistics.median(times), "max_s": max(times),
           "create_s": creates, "create_median_s": statistics.median(creates)}
    print(f"a new tenant's first forward_backward: median {out['median_s']:.3f} s, max {out['max_s']:.3f} s "
          f"(create_lora_training_client itself: median {out['create_median_s']:.3f} s)", flush=True)
    return out


def sdk_rates(args, path: str) -> dict[str, Any]:
    """The whole path, through the SDK over HTTP (Serve's gateway, the TinkerService, its learner; auth on):
    ``--sdk-users`` clients looping one-datum steps (forward_backward and optim_step sent together, as the SDK's
    clients send them), on a fresh service with the service's coalescing (``scheduling.coalesce_tokens``, the
    default) and on one without (0), alternating: datums/s and requests per learner call, each run's."""
    import ray
    import tinker

    from benchmarks.tinker_fairness import datum, sdk_step
    from otray.models import load_tokenizer
    from otray.tinker.config import TinkerScheduling, load_tinker
    from otray.tinker.gateway.app import run
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    tmp = Path(tempfile.mkdtemp(prefix="otray-sdk-rates-"))
    key = alice_key(tmp)
    data = [datum(load_tokenizer(path).encode(TEXT))]
    if args.sdk_compare == "ahead":  # clients sending ahead, the service handing calls over ahead or not
        kinds = [("one_at_a_time", {"calls_ahead": 1}), ("ahead", {"calls_ahead": TinkerScheduling().calls_ahead})]
        stepper = sdk_ahead_step
    else:
        kinds = [("uncoalesced", {"coalesce_tokens": 0}), ("coalesced", {})]
        stepper = sdk_step
    out: dict[str, Any] = {"users": args.sdk_users, "compare": args.sdk_compare, **{label: [] for label, _ in kinds}}
    for r in range(args.sdk_rounds):  # alternating (a b, b a, ...): the machine's drift hits both
        for label, scheduling in kinds if r % 2 == 0 else kinds[::-1]:
            run(load_tinker({"port": PORT, "storage": str(tmp / f"{label}-{r}"), "scheduling": scheduling,
                             "models": [{"name": "tiny", "path": path, "learner_cpus": 1, "num_threads": 1,
                                         "sampler": {"engine": "learner"}}]}))
            service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{PORT}", api_key=key)
            clients = [service.create_lora_training_client(base_model="tiny", rank=args.rank).result()
                       for _ in range(args.sdk_users)]
            for c in clients:
                sdk_step(c, data)()
            actor = ray.get_actor(NAME, namespace=NAMESPACE)
            before = ray.get(actor.learner_use.remote())["tiny"]["batched"]
            stop = threading.Event()
            threads = [Stepper(stepper(c, data), stop) for c in clients]
            window = run_window(threads, stop, args)
            after = ray.get(actor.learner_use.remote())["tiny"]["batched"]
            done = sum(1 for t in threads for s in t.steps if window.start <= s[0] + s[1] < window.end)
            calls = after["calls"] - before["calls"]
            got = {"datums_per_s": done / window.seconds,
                   "requests_per_learner_call": (after["members"] - before["members"]) / calls if calls else None}
            out[label].append(got)
            print(f"SDK, {args.sdk_users} clients, {label}: {got['datums_per_s']:.1f} datums/s, "
                  f"{got['requests_per_learner_call'] or 0:.1f} requests a learner call", flush=True)
            service.close("success").result()
            end_service()
    (a, _), (b, _) = kinds
    rate = {k: statistics.median(g["datums_per_s"] for g in out[k]) for k in (a, b)}
    out[f"{b}_over_{a}_median"] = rate[b] / rate[a]
    print(f"SDK, {args.sdk_users} clients: {b} over {a} {rate[b] / rate[a]:.2f}x (medians)", flush=True)
    return out


def sdk_ahead_step(client: Any, data: list[Any]) -> Callable[[], None]:
    """A tinker SDK client's step as tinker-cookbook's loop sends it (submit ahead): the next step's forward_backward
    and optim_step sent before this one's results are awaited."""
    from tinker import types

    pending: list[tuple[Any, Any]] = []

    def step() -> None:
        pending.append((client.forward_backward(data, "cross_entropy"),
                        client.optim_step(types.AdamParams(learning_rate=1e-5))))
        if len(pending) > 1:
            [f.result() for f in pending.pop(0)]

    return step


def end_service() -> None:
    """Serve shut down and the service's named, detached actors (the TinkerService, the learner) killed, their
    names free: the next part's service starts its own, with its own config."""
    import ray
    from ray import serve

    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    serve.shutdown()
    for name in (NAME, f"{NAME}-learner-tiny"):
        while True:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                break
            time.sleep(0.1)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", help="a tiny model shape: tiny, 4m, 100m, 0.5b, 1.5b")
    ap.add_argument("--gpu", action="store_true", help="the learner on a GPU")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--tenants", type=int, default=5)
    ap.add_argument("--sdk-users", type=int, default=8, help="the clients of the sdk part")
    ap.add_argument("--sdk-rounds", type=int, default=2, help="the sdk part's alternations of its two services")
    ap.add_argument("--sdk-compare", choices=("coalesce", "ahead"), default="coalesce",
                    help="the sdk part's two services: coalescing small calls or not (clients awaiting each step), or "
                         "handing a model's next call over while its last is on the learner or not "
                         "(scheduling.calls_ahead 2 / 1; clients sending their next step ahead)")
    ap.add_argument("--rank", type=int, default=32, help="the LoRA rank of the throughput and kernels parts (the SDK's default: 32)")
    ap.add_argument("--users", default=",".join(map(str, USERS)), help="the N of the throughput part")
    ap.add_argument("--parts", default="throughput,tenant,kernels")
    ap.add_argument("--modes", default="own,shared,followers",
                    help="learners measured side by side (own first): own, own2 (a pass per user on 2 torch threads), "
                         "shared, shared2 (shared on 2 torch threads), shared_alone (shared, never coalesced by --client service), followers (wait_for_followers), side (shared "
                         "with the side lane: 2 lanes of 1 thread), "
                         "inline (shared, each optimizer update run before its step is answered), graphs (shared, "
                         "bucketed passes: models[i].graph_passes, CUDA graphs on a GPU), own_kept (own, with turns "
                         "kept among users looping alike, as before session 69), pairs_apart and own_apart (shared "
                         "and own, a train_step's two parts two turns of the queue, as before session 70)")
    ap.add_argument("--client", choices=("sequential", "pipelined", "ahead", "fused", "fused-ahead", "service",
                                         "service-ahead"),
                    default="service",
                    help="how a throughput user sends a step: forward_backward's result awaited before optim_step "
                         "is sent; both sent together and then awaited (the tinker SDK's clients); ahead: as "
                         "pipelined, the next step sent before this one is awaited (tinker-cookbook's supervised "
                         "loop, submit_ahead=1); fused: both in one call (SharedLearner.train_step, what the service "
                         "sends for a queued pair); fused-ahead: fused, the next step sent before this one is awaited; "
                         "service: fused, through a relay actor ordering each client's calls and coalescing as the "
                         "TinkerService does (LearnerCalls: own and shared_alone alone, the others "
                         "scheduling.coalesce_tokens); service-ahead: service, the next step sent before this one "
                         "is awaited")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tinker_shared_passes.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from otray.models import resolve_model_path

    path = resolve_model_path("tiny" if args.shape == "tiny" else f"tiny-{args.shape}", ROOT / ".cache" / "models")
    parts = args.parts.split(",")
    own = not ray.is_initialized() and bool({"throughput", "tenant", "sdk"} & set(parts))
    out: dict[str, Any] = {"args": vars(args), "model": path, "through": f"Ray calls to the SharedLearner, {args.client} clients",
                           "targets": {"shared_over_own_at_8_min": 5.0 if args.gpu else 3.0, "tenant_first_step_max_s": 1.0}}
    if Path(args.out).exists():  # a part not run now keeps its last figures
        kept = json.loads(Path(args.out).read_text())
        out.update({k: kept[k] for k in ("throughput", "tenant", "kernels", "sdk") if k in kept and k not in parts})
    if "kernels" in parts:  # first: seconds, and a time cap on the rest keeps it
        out["kernels"] = kernels(args, path)
        save(out, args.out)
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the part's learner is gone; the Ray learners of the next part share the device
    if own:  # after the kernels part, whose seconds a starting Ray's processes would share the CPU with
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)  # logical: one learner is measured at a time
    if "throughput" in parts:
        out["throughput"] = learner_rates(args, path, lambda rows: save({**out, "throughput": rows}, args.out))
    if "tenant" in parts:
        out["tenant"] = tenant_start(args, path)
    if "sdk" in parts:
        out["sdk"] = sdk_rates(args, path)
    save(out, args.out)
    if own:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
