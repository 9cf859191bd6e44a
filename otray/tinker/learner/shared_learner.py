"""SharedLearner: the Ray actor behind each base model of the Tinker service, an
:class:`~otray.tinker.learner.adapter_learner.AdapterLearner` whose users take fair turns.

Every call names the user it is for. Calls reach the actor at once (it is an async actor) and wait
in its :class:`~otray.tinker.learner.fair.FairQueue`; the step whose turn it is runs on the learner's one
compute thread. A ``forward_backward`` takes a turn per slice of at most ``slice_tokens`` tokens
(losses are sums over tokens, so the slices' gradients add up to the whole call's), and the
slices' outputs are joined, so callers see one call. A ``sample`` takes a turn per ``sample_turn_s`` of decoding,
each going on from the last one's KV cache, so callers see one call there too.

Slices of different clients share a pass (``pass_tokens``): the queue packs the next slices of
several clients, in fair order, into one call of :meth:`AdapterLearner.forward_many`, where each row
goes through its own adapter; a small user's one-datum step then rides in the next pass instead of
costing a pass of its own. A pass that fails as a whole before adding any gradient is run again
request by request, so a bad request fails alone.

The queue lives here, beside the model, so the next step starts the moment the last one ends: a
queue in the service instead left the learner idle for a round trip per call (a third of a busy
user's throughput on two cores) and gave a client's pipelined ``optim_step`` turn away while it
travelled.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from otray.device import settle_heap
from otray.tinker.config import Share
from otray.tinker.errors import UserError
from otray.tinker.learner.calls import LearnerCall, PairCall, PassCall
from otray.tinker.learner.fair import FairQueue, Packable, slices
from otray.tinker.learner.fair_jobs import AGAIN
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from otray.tinker.learner.sample_jobs import SampleJob, SampleOut
from otray.tinker.learner.passes import PassNotRun, PassRequest, PassResult, TrainStepResult
from otray.tinker.learner.loss_graph import LossGraph
from otray.tinker.learner.loss_run import GraphClock, add_sums
from otray.types import Datum


OPTIM = ("optim_step",)  # the pack key of optimizer steps


def sendable(e: BaseException) -> BaseException:
    """``e``, or, when it cannot be pickled (a custom loss's own exception may hold anything), a RuntimeError with
    its type and text: an answer list holding it must still reach the other callers."""
    from ray import cloudpickle  # what Ray pickles answers with

    try:
        cloudpickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - anything pickling raises
        return RuntimeError(f"{type(e).__name__}: {e}")


@dataclass
class _Slice:
    """One slice of a forward_backward call, as the queue packs it: ``saved`` (a custom loss's backward)
    holds the adapter's gradients from before the call, shared by the call's slices; ``then``: the optim_step
    of a one-slice :meth:`SharedLearner.train_step`, answered in the pass's hop (:class:`_Pair`)."""

    request: PassRequest
    saved: Optional[list]
    then: Optional[AdamStep] = None


@dataclass
class _Pair:
    """What a :class:`_Slice` with ``then`` gives back: the pass's result and the optimizer step's answer, each
    or its exception (the step runs whether or not the pass failed, as a second call would)."""

    passed: Any
    stepped: Any


class SharedLearner:
    """Ray actor: one base model's adapters, trained and sampled in fair turns (``policy``: fair | fifo;
    ``shares``: an admin's weights and priorities by user; ``slice_tokens``: 0 for whole calls;
    ``follow_s``: how long a turn is kept for a forward_backward's optim_step, :meth:`~otray.tinker.learner.kept_turns.KeptTurns.hold`;
    ``pass_tokens``: slices of several clients share a pass up to this many tokens, 0: never;
    ``wait_for_followers``: optimizer steps first and shared calls wait for their clients' next jobs,
    :mod:`otray.tinker.learner.fair`'s "Cohorts"; ``side_tokens``: small steps of other clients, up to this many
    tokens a call, run on a second compute thread beside a pass, 0: never, the fair queue's "side lane";
    ``sample_turn_s``: a sampling call's turns end at their first decode step past it, 0: calls whole)."""

    pair_turns = True  # a one-slice train_step is one turn of the queue (False: two, as before; a benchmark's mode)

    def __init__(self, model_path: str, *, policy: str = "fair", slice_tokens: int = 0, follow_s: float = 0.05,
                 shares: Optional[dict[str, Share]] = None, pass_tokens: int = 0, wait_for_followers: bool = False,
                 side_tokens: int = 0, sample_turn_s: float = 0.0, **learner: Any):
        # imported here, in the actor: the TinkerService that creates it then does without torch
        from otray.tinker.learner.adapter_learner import AdapterLearner

        self.learner = AdapterLearner(model_path, **learner)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="learner")  # the model's compute thread
        # the side lane's: small packable steps (their own adapters' rows) beside a pass of the first thread
        self.side_pool = ThreadPoolExecutor(1, thread_name_prefix="learner-side") if side_tokens > 0 else None
        self.queue = FairQueue(shares, policy, follow_s, self._pack, pass_tokens,
                               first_keys=(OPTIM,) if wait_for_followers else (),
                               side=self._side_pack if side_tokens > 0 else None, side_tokens=side_tokens,
                               paused=self.learner.gate.paused_now)
        if self.side_pool is not None:  # the main lane's thread waits while a side call runs (LaneGate)
            self.pool.submit(self.learner.gate.bind_main).result()
        self.slice_tokens = slice_tokens if policy == "fair" else 0
        self.sample_turn_s = sample_turn_s if policy == "fair" and sample_turn_s > 0 else None  # None: calls whole
        self.sampling: dict[str, bool] = {}  # named sampling calls queued or running -> abandoned (abort_sample)
        self.aborted = 0  # sampling calls ended early (abort_sample)
        self.train_steps = 0  # train_step calls (a forward_backward and its optim_step in one)
        self.batched = {"calls": 0, "members": 0}  # calls() calls and the training calls they held
        settle_heap()  # a full garbage collection would otherwise stall whichever user's step it fell in

    def _step(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return lambda: asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def _one(self, user: str, client: str, fn: Callable[..., Any], *args: Any) -> Any:
        return (await self.queue.run(user, client, [self._step(fn, *args)]))[0]

    def ping(self) -> bool:
        return True

    async def until_gone(self) -> None:
        """Never answers: the service holds this call and ends this learner's models when it fails."""
        await asyncio.Event().wait()

    def usage(self) -> dict[str, Any]:
        """Learner seconds and steps by user since the actor started, the seconds turns were kept for a
        follower (:meth:`~otray.tinker.learner.kept_turns.KeptTurns.hold`), shared calls, packable calls and their steps by pack key, the
        sampling calls ended early (:meth:`abort_sample`), the side lane's calls and steps, and the
        :meth:`train_step` calls, the :meth:`calls` calls with the training calls they held, and with
        ``graph_passes`` the bucketed passes, those replayed as CUDA graphs, the captures and the failed ones."""
        graphs = self.learner.graphs
        return {"seconds": dict(self.queue.used), "steps": dict(self.queue.steps), "held_s": self.queue.followers.held,
                "shared": dict(self.queue.shared), "packed": {k: dict(v) for k, v in self.queue.packed.items()},
                "aborted_samples": self.aborted, "side": dict(self.queue.side.calls), "train_steps": self.train_steps,
                "batched": dict(self.batched),
                "graphs": {**graphs.counts, "failed": len(graphs.failures)} if graphs is not None else None}

    async def adapters(self) -> list[str]:
        return self.learner.adapters()

    async def create(self, user: str, adapter: str, spec: AdapterSpec) -> None:
        await self._one(user, adapter, self.learner.create, adapter, spec)

    async def drop(self, user: str, adapter: str, why: str = "it was unloaded") -> None:
        """The adapter's calls still queued fail at once (none of their rows reaches a pass); the one on the
        learner now ends first."""
        self.queue.withdraw(user, adapter, UserError(f"model {adapter!r} left the learner before this request "
                                                     f"ran ({why})", 404))
        await self._one(user, adapter, self.learner.drop, adapter)

    async def forward_backward(self, user: str, adapter: str, datums: list[Datum], loss_fn: str,
                               loss_fn_config: Optional[dict[str, float]] = None, backward: bool = True,
                               graph: Optional[LossGraph] = None) -> PassResult:
        return await self._queued(user, adapter, *_slices(adapter, datums, loss_fn, loss_fn_config, backward, graph,
                                                             self.slice_tokens))

    async def _queued(self, user: str, adapter: str, requests: list[PassRequest], saved: Optional[list]) -> PassResult:
        """A forward_backward call's slices (:func:`_slices`) as one job of ``adapter``, a step each; joined."""
        return _joined(await self.queue.run(user, adapter, [
            Packable(r.pack_key(), r.tokens(), _Slice(r, saved)) if r.pack_key() is not None
            else self._step(self._pass, adapter, r.datums, r.loss_fn, r.loss_fn_config, r.backward, r.graph, saved)
            for r in requests], follow=requests[0].backward))

    def _pass(self, adapter: str, datums: list[Datum], loss_fn: str, cfg: Optional[dict[str, float]], backward: bool,
              graph: Optional[LossGraph], saved: Optional[list]) -> PassResult:
        """One slice, on the compute thread. ``saved`` (a custom loss's backward): the first slice keeps the
        adapter's gradients as they were before the call, and a slice that fails puts them back, so a loss
        that fails on some datum leaves no part of the call's gradient for the next optim_step."""
        self._keep_grads(adapter, saved)
        try:
            return self.learner.forward_backward(adapter, datums, loss_fn, cfg, backward, graph)
        except Exception:
            self._put_back_grads(adapter, saved)
            raise

    def _keep_grads(self, adapter: str, saved: Optional[list]) -> None:
        """A custom loss's call, at its first slice: keep ``adapter``'s gradients as they are in ``saved``."""
        if saved is not None and not saved and adapter in self.learner.specs:
            saved.append([None if p.grad is None else p.grad.clone()
                          for p in self.learner.switch.params(self.learner.model, adapter)])

    def _put_back_grads(self, adapter: str, saved: Optional[list]) -> None:
        """The call failed: ``adapter``'s gradients back as :meth:`_keep_grads` kept them (no part of the call's
        gradient is left for the next optim_step)."""
        for p, grad in zip(self.learner.switch.params(self.learner.model, adapter), saved[0] if saved else ()):
            p.grad = grad

    async def _pack(self, works: list[Any], pool: Optional[ThreadPoolExecutor] = None) -> list[Any]:
        """Packed steps on the compute thread in one hop: forward_backward slices in a shared pass, optimizer
        steps in one fused AdamW call (clients that stepped together send theirs together)."""
        if isinstance(works[0], _Slice):
            run: Callable[[list[Any]], list[Any]] = self._passes
        else:  # beside a side lane (whose thread may take these adapters next) the update runs in the same hop
            run = self.learner.optim_many if self.side_pool is not None else self._optim_answers
        if pool is not None:  # a side call: it computes alone
            run = functools.partial(self._alone_beside, run)
        return await asyncio.get_running_loop().run_in_executor(pool or self.pool, run, works)

    def _alone_beside(self, run: Callable[[list[Any]], list[Any]], works: list[Any]) -> list[Any]:
        """A side-lane call (on its thread) while the main lane's pass waits at its next LoRA layer."""
        with self.learner.gate.side():
            return run(works)

    def _optim_answers(self, works: list[tuple[str, AdamStep]]) -> list[Any]:
        """Optimizer steps answered before their update runs (on the compute thread): everything a step answers
        (gradient norms, step counts) is known once the gradients are clipped, so the fused AdamW update goes
        next in the compute thread's queue, ahead of any later work, and runs while the answers travel and the
        clients send their next calls (the learner would idle then: ~6 of a ~40 ms cycle of 8 one-datum users
        here). What the update does not overlap falls in the next call's seconds, charged to that call's members
        by tokens. An update that fails leaves its adapters refused
        (:meth:`~otray.tinker.learner.adapter_steps.AdapterSteps.answers`)."""
        outs, update = self.learner.optim_answers(works)
        self.pool.submit(update)  # from the compute thread itself: queued before anything that reads the answers
        return outs

    async def _side_pack(self, works: list[Any]) -> list[Any]:
        """:meth:`_pack` on the side lane's thread: the queue runs it only beside a packable step of the first
        thread (shared passes route rows per thread, and touch only their own adapters' parameters), which waits
        at its next LoRA layer until this call ends (:class:`~otray.tinker.learner.lane_gate.LaneGate`)."""
        return await self._pack(works, self.side_pool)

    def _passes(self, works: list[_Slice]) -> list[Any]:
        """Slices of several clients in one shared pass, on the compute thread; each a PassResult or its
        exception. A custom loss's call that fails gets its adapter's gradients back as before the call."""
        for w in works:
            self._keep_grads(w.request.adapter, w.saved)
        try:
            outs: list[Any] = self.learner.forward_many([w.request for w in works])
        except PassNotRun:  # e.g. a datum the model cannot take: each alone, so only its own request fails
            outs = [self._alone(w) for w in works]
        except Exception as e:  # noqa: BLE001 - after some gradient was added: every request of the pass fails
            outs = [e] * len(works)
        for w, out in zip(works, outs):
            if isinstance(out, Exception) and w.saved:
                self._put_back_grads(w.request.adapter, w.saved)
        pairs = [i for i, w in enumerate(works) if w.then is not None]
        if pairs:  # one-slice train_steps: their optimizer steps answered in this hop, as :meth:`_pack` runs them
            steps = [(works[i].request.adapter, works[i].then) for i in pairs]
            try:
                answers = self.learner.optim_many(steps) if self.side_pool is not None else self._optim_answers(steps)
            except Exception as e:  # noqa: BLE001 - not one adapter's failure (those come back as answers)
                answers = [e] * len(pairs)
            for i, answer in zip(pairs, answers):
                outs[i] = _Pair(outs[i], answer)
        return outs

    def _alone(self, w: _Slice) -> Any:
        """One slice in a pass of its own: its result, or its own exception (the cause of a PassNotRun)."""
        try:
            return self.learner.forward_many([w.request])[0]
        except Exception as e:  # noqa: BLE001 - this request's own failure
            return e.__cause__ if isinstance(e, PassNotRun) and isinstance(e.__cause__, Exception) else e

    async def optim_step(self, user: str, adapter: str, step: AdamStep) -> dict[str, float]:
        """Packable with other clients' optimizer steps (one hop to the compute thread for all)."""
        return (await self.queue.run(user, adapter, [Packable(OPTIM, 1, (adapter, step))]))[0]

    async def train_step(self, user: str, adapter: str, datums: list[Datum], loss_fn: str, step: AdamStep,
                         loss_fn_config: Optional[dict[str, float]] = None,
                         graph: Optional[LossGraph] = None) -> TrainStepResult:
        """A client's forward_backward and the optim_step after it in one call (one round trip, not two; the
        service sends a pipelined pair so), each part run as its own call would run it, the second whether or not
        the first failed; each part's result or its exception. A one-slice forward_backward and its step are one
        turn of the queue, the step answered in the pass's hop (:meth:`_passes`; a learner without shared passes
        ran 1.11-1.16x the steps a second so: NOTES "Issue 53"); a longer one goes as two jobs, in that order."""
        self.train_steps += 1
        requests, saved = _slices(adapter, datums, loss_fn, loss_fn_config, True, graph, self.slice_tokens)
        if self.pair_turns and len(requests) == 1 and requests[0].pack_key() is not None:  # one turn, one hop
            r = requests[0]
            try:
                (pair,) = await self.queue.run(user, adapter, [Packable(r.pack_key(), r.tokens(), _Slice(r, saved, step))])
            except Exception as e:  # noqa: BLE001 - the job failed whole (withdrawn: its model left the learner)
                return TrainStepResult(sendable(e), sendable(e))
            passed = pair.passed if isinstance(pair.passed, BaseException) else _joined([pair.passed])
            return TrainStepResult(*[sendable(d) if isinstance(d, BaseException) else d for d in (passed, pair.stepped)])
        fb = asyncio.ensure_future(self._queued(user, adapter, requests, saved))
        opt = asyncio.ensure_future(self.optim_step(user, adapter, step))  # (tasks start in order: fb queues first)
        done = await asyncio.gather(fb, opt, return_exceptions=True)
        return TrainStepResult(*[sendable(d) if isinstance(d, BaseException) else d for d in done])

    async def calls(self, calls: list[LearnerCall]) -> list[Any]:
        """Training calls of several clients sent as one (the service coalesces small ones: a Ray call costs this
        process ~2 ms of Python on the GIL its passes need, :mod:`otray.tinker.service.learner_calls`): each queued
        in list order, as its own call would be, and answered in one list, each its result or its exception."""
        self.batched["calls"] += 1
        self.batched["members"] += len(calls)
        outs = await asyncio.gather(*[self._call(c) for c in calls], return_exceptions=True)
        return [sendable(o) if isinstance(o, BaseException) else o for o in outs]

    def _call(self, c: LearnerCall) -> Any:
        if isinstance(c, PairCall):
            r = c.first.request
            return self.train_step(c.first.user, r.adapter, r.datums, r.loss_fn, c.step, r.loss_fn_config, r.graph)
        if isinstance(c, PassCall):
            r = c.request
            return self.forward_backward(c.user, r.adapter, r.datums, r.loss_fn, r.loss_fn_config, r.backward, r.graph)
        return self.optim_step(c.user, c.adapter, c.step)

    async def save(self, user: str, adapter: str, path: str, optimizer: bool, version: Optional[int] = None) -> int:
        return await self._one(user, adapter, self.learner.save, adapter, path, optimizer, version)

    async def load(self, user: str, adapter: str, path: str, optimizer: bool, create: bool) -> AdapterSpec:
        return await self._one(user, adapter, self.learner.load, adapter, path, optimizer, create)

    async def sample(self, jobs: list[SampleJob], user: str = "", call: str = "") -> list[list[SampleOut]]:
        """As :meth:`AdapterLearner.sample`, in ``user``'s turns: a turn decodes up to its first step past
        ``sample_turn_s`` at which another user's work waits (0, and the fifo policy: the call whole), so another
        user's step waits for one turn of a long sampling call, not all of it, and a call alone runs in one turn
        (:class:`~otray.tinker.learner.learner_sampling.SampleRun`; each turn charged as a step). ``call``: the
        caller's name for it, which :meth:`abort_sample` takes."""
        stop = None
        if call:
            self.sampling[call] = False
            stop = lambda: self.sampling.get(call, False)  # noqa: E731
        # a turn ends past its time only while another user's job waits (her own clients take turns between calls:
        # cutting hers for each other cost her the cuts and a user stepping beside her a turn's length a step)
        run = self.learner.sample_run(jobs, stop, self.sample_turn_s, lambda: self.queue.others_wait(user))
        turn = lambda: run.outs if run.turn() else AGAIN  # noqa: E731
        try:
            return (await self.queue.run(user, f"sampling:{user}", [self._step(turn)]))[0]
        finally:
            if run.holding:  # its job failed in the queue between turns (a done or failed turn freed it): free it
                # on the compute thread, after any turn of it there (an answered call does not wait behind the
                # next step the queue already sent there)
                await self._step(run.close)()
            if call:
                self.aborted += self.sampling.pop(call)

    def abort_sample(self, call: str) -> bool:
        """End sampling call ``call`` early: every request in it was abandoned (``cancel_future``). Running,
        it stops at its next token; still queued, it samples nothing. False when no such call is here."""
        if call not in self.sampling:
            return False
        self.sampling[call] = True
        return True


def _slices(adapter: str, datums: list[Datum], loss_fn: str, loss_fn_config: Optional[dict[str, float]],
            backward: bool, graph: Optional[LossGraph], slice_tokens: int) -> tuple[list[PassRequest], Optional[list]]:
    """A forward_backward call's slices of at most ``slice_tokens`` tokens (0: whole), each a request (a turn of its
    own), and the ``saved`` list its slices share (a custom loss's backward: :meth:`SharedLearner._keep_grads`)."""
    if graph is not None:  # the call's runs of its loss share one clock (custom_losses.max_call_s)
        graph = dataclasses.replace(graph, clock=GraphClock(graph.call_s))
    cost = graph.datum_cost if graph is not None else 0  # a custom loss's datum is charged more than its tokens
    parts = slices([len(d) + cost for d in datums], slice_tokens) if slice_tokens else [range(len(datums))]
    saved: Optional[list] = [] if graph is not None and backward else None
    return [PassRequest(adapter, datums[p.start:p.stop], loss_fn, loss_fn_config, backward, graph) for p in parts], saved


def _joined(results: list[PassResult]) -> PassResult:
    """A forward_backward call's slices' results as one."""
    return PassResult([lp for r in results for lp in r.logprobs], [x for r in results for x in r.losses],
                      sum(r.loss_sum for r in results), functools.reduce(add_sums, [r.metric_sums for r in results]))
