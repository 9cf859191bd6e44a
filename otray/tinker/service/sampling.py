"""Sample requests, batched: those that arrive while a base model's samplers are busy go to them in
one call each: the vLLM engine takes what it can serve (:class:`~otray.tinker.service.engines.VllmSamplers`),
the learner the rest (one ``generate`` per (sampler, settings) group there), and each request's
promise is finished with its own protobuf result. A batch first waits ``sample_batch_wait_ms`` for the rest of the requests
a client sent together: without it the first of 8 concurrent requests went alone and the other 7
in a second call (benchmarks/tinker_api.py, RL step).

On the learner each user's requests are calls of their own, one at a time per user, in that user's
turn (:class:`~otray.tinker.learner.shared_learner.SharedLearner`, with the training calls); the batcher
does not wait for them, and the learner decodes a call in turns of about ``scheduling.sample_turn_ms``
(:class:`~otray.tinker.learner.learner_sampling.SampleRun`), so one user's long sampling call delays another's
requests (and training steps) by about one turn, not all of it, and cannot fail them. The vLLM engine takes every user's requests of a batch
together (its own scheduler interleaves them token by token); the next batch for it waits for that
call, so a batch for it holds at most ``sample_call_max_samples`` samples, taken in turns over the users
waiting (:func:`fair_cut`): a request waits for at most one call of another user's flood.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import collections
import functools
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import ray

from otray.tinker.learner.sample_jobs import SampleJob
from otray.tinker.service import runs as R
from otray.tinker.service.engines import VllmSamplers
from otray.tinker.service.healing import until_up
from otray.tinker.service.futures import Futures, Outcome
from otray.tinker.learner.prompt_scores import Scoring, Targets, cut_before, fill_response
from otray.tinker.service.stability import Recorded
from otray.tinker.wire.sampling import sample_output
from otray.tinker.errors import UserError


@dataclass
class SampleWait:
    """One checked ``asample`` request waiting for its learner."""

    request_id: str
    adapter: Optional[str]  # the sampler checkpoint's directory, None for the base model
    prompt: list[int]
    params: Any  # otray.types.SamplingParams (hashable: the grouping key)
    n: int
    scoring: Scoring  # prompt logprobs, top-K, alternative tokens (otray.tinker.learner.prompt_scores)
    last_n: Optional[int]
    record: Optional[tuple[str, str]] = None  # (owner, session): record each sample's stability info
    images: tuple[Any, ...] = ()  # the prompt's images (otray.vision.Image), whose tokens it holds
    targets: Optional[Targets] = None  # target_prompt_logprobs

    def learner_only(self) -> bool:
        """Images, top-K, targets and alternative tokens: the vLLM samplers are not given them (yet)."""
        return bool(self.images) or self.scoring.needs_learner() or self.targets is not None


Groups = dict[tuple, list[SampleWait]]  # (owner, adapter, params, n, scoring, learner only?) -> its requests
Queue = list[tuple[str, SampleWait]]  # (owner, request) in arrival order


def fair_cut(queue: Queue, budget: int, capped: Callable[[SampleWait], bool]) -> tuple[Queue, Queue]:
    """(the requests of this batch, those left for the next). Requests that are not ``capped`` (the
    learner's: each user's go in calls of their own anyway) all go now. Capped ones (the vLLM engine's,
    which takes a batch in one call) are taken in turns over their owners, each owner's in arrival order,
    until their samples reach ``budget``; at least one always goes. So one user's flood is cut into calls,
    and another user's request, taken in the first turn of the next batch, waits for one call of it."""
    turns: dict[str, collections.deque] = {}
    for owner, w in queue:
        if capped(w):
            turns.setdefault(owner, collections.deque()).append((owner, w))
    taken: Queue = []
    used = 0
    while turns and (used < budget or not taken):
        for owner in list(turns):
            if used >= budget and taken:
                break
            item = turns[owner].popleft()
            taken.append(item)
            used += item[1].n
            if not turns[owner]:
                del turns[owner]
    arrival = {id(w): i for i, (_, w) in enumerate(queue)}
    left = sorted((item for items in turns.values() for item in items), key=lambda item: arrival[id(item[1])])
    return [(o, w) for o, w in queue if not capped(w)] + taken, left


class SampleBatcher:
    def __init__(self, learners: dict[str, Any], engines: VllmSamplers, futures: Futures, wait_s: float,
                 record: Callable[[str, Recorded], None], call_max_samples: int = 512):
        self.learners = learners
        self.call_max_samples = call_max_samples  # per vLLM call, taken in turns over users (fair_cut)
        self.record = record  # (sequence id, what was sampled): stable_reinforce's stability info
        self.engines = engines  # the vLLM samplers, and which requests they take
        self.wait_s = wait_s  # a batch waits this long for requests sent together (the SDK sends one per prompt)
        self.futures = futures
        self.waiting: dict[str, list[tuple[str, SampleWait]]] = {m: [] for m in learners}  # (owner, request)
        self.busy: dict[str, bool] = {m: False for m in learners}
        self.calls: list[int] = []  # prompts per batch, the latest 1,000 (batching, for benchmarks)
        self.prompts = {"learner": 0, "vllm": 0}  # prompts sampled by each engine
        self.split_batches = 0  # shared calls that failed and were sent again one request at a time
        self.learner_waiting: dict[tuple[str, str], Groups] = {}  # (base, owner) -> requests for the learner
        self.learner_busy: set[tuple[str, str]] = set()  # (base, owner) with a learner call running
        self.tasks: set[asyncio.Task] = set()
        self.live: set[str] = set()  # request ids submitted and not finished (what cancel_future may name)
        self.learner_calls: dict[str, tuple[Any, set[str]]] = {}  # learner call -> (learner, its uncancelled requests)
        self.cancelled = {"waiting": 0, "running": 0}  # cancel_future calls by the state they found
        self.versions: dict[str, dict[int, int]] = {}  # inflight target dir -> its version -> requests it served

    def submit(self, base: str, owner: str, wait: SampleWait) -> None:
        self.live.add(wait.request_id)
        self.waiting[base].append((owner, wait))
        if not self.busy[base]:
            self.busy[base] = True
            asyncio.get_running_loop().create_task(self._drain(base))

    async def _drain(self, base: str) -> None:
        try:
            while self.waiting[base]:
                await asyncio.sleep(self.wait_s)
                batch, self.waiting[base] = fair_cut(self.waiting[base], self.call_max_samples,
                                                     lambda w: self.engines.serves(base, w.adapter) and not w.learner_only())
                self.calls = [*self.calls[-999:], len(batch)]
                groups: Groups = {}
                for owner, w in batch:
                    groups.setdefault((owner, w.adapter, w.params, w.n, w.scoring, w.learner_only()), []).append(w)
                engine, fast = None, {k: ws for k, ws in groups.items() if self.engines.serves(base, k[1]) and not k[5]}
                if fast:
                    try:
                        engine = await self.engines.actor(base)
                    except RuntimeError as e:  # engine: vllm, and it did not start
                        self._fail(fast, str(e))
                        groups = {k: ws for k, ws in groups.items() if k not in fast}
                    fast = fast if engine is not None else {}  # auto without an engine: the learner's
                self._to_learner(base, {k: ws for k, ws in groups.items() if k not in fast})
                if await self._run(engine, "vllm", fast):  # the engine's process is gone: the next request starts one
                    self.engines.forget(base)
        finally:
            self.busy[base] = False

    def _to_learner(self, base: str, groups: Groups) -> None:
        """Each user's requests for the learner: one call per user at a time, taken in that user's turn
        there; what comes while a user's call runs waits for it and goes in that user's next call. Not
        awaited here, so one user's long sampling call does not hold up the next batch (other users')."""
        for k, ws in groups.items():
            key = (base, k[0])
            self.learner_waiting.setdefault(key, {}).setdefault(k, []).extend(ws)
            if key not in self.learner_busy:
                self.learner_busy.add(key)
                task = asyncio.get_running_loop().create_task(self._learner_drain(key))
                self.tasks.add(task)  # kept: the loop holds only weak references
                task.add_done_callback(self.tasks.discard)

    async def _learner_drain(self, key: tuple[str, str]) -> None:
        base, owner = key
        try:
            while self.learner_waiting.get(key):
                await self._run(self.learners[base], "learner", self.learner_waiting.pop(key), owner)
        finally:
            self.learner_busy.discard(key)

    async def _run(self, sampler: Any, name: str, groups: Groups, owner: str = "", again: bool = True) -> bool:
        """One ``sample`` call of ``sampler`` (a learner or a vLLM engine) for ``groups``; each request's
        promise gets its result, or the call's error. True when the sampler's actor died. A learner that
        died under the call (Ray starts it again; sampling needs nothing of the old one) is asked once more."""
        if not groups:
            return False
        call = uuid.uuid4().hex if name == "learner" else ""
        if call:  # cancel_future ends the call early once every request in it is cancelled
            self.learner_calls[call] = (sampler, {w.request_id for ws in groups.values() for w in ws})
        try:
            return await self._call(sampler, name, groups, owner, again, call)
        finally:
            self.learner_calls.pop(call, None)

    async def _call(self, sampler: Any, name: str, groups: Groups, owner: str, again: bool, call: str) -> bool:
        """:meth:`_run`'s call; ``call``: its name on the learner (:meth:`SharedLearner.abort_sample`)."""
        jobs = [SampleJob(k[1], [w.prompt for w in ws], k[2], k[3], k[4],
                          [w.images for w in ws] if any(w.images for w in ws) else None,
                          [w.targets for w in ws] if any(w.targets is not None for w in ws) else None)
                for k, ws in groups.items()]
        try:
            results = await (sampler.sample.remote(jobs, owner, call) if call else sampler.sample.remote(jobs))
        except ray.exceptions.RayActorError as e:
            if name == "learner" and again and await until_up(sampler):
                return await self._run(sampler, name, groups, owner, again=False)
            resend = "; send the request again: a new engine is started" if name == "vllm" else ""
            self._fail(groups, f"the {name} sampler died ({R.cause(e)}){resend}")
            return True
        except Exception as e:  # noqa: BLE001 - every waiting request learns why
            if sum(len(ws) for ws in groups.values()) > 1:
                return await self._one_by_one(sampler, name, groups, owner)
            self._fail(groups, R.cause(e))
            return False
        self.prompts[name] += sum(len(j.prompts) for j in jobs)
        for ws, outs in zip(groups.values(), results):
            for w, out in zip(ws, outs):
                if w.request_id not in self.live:  # cancelled while it ran: its result is dropped
                    continue
                if w.record is not None:
                    prompt = np.asarray(w.prompt, np.int32)  # one array for the request's samples
                    for i, s in enumerate(out.samples):
                        self.record(f"{w.request_id}:{i}", Recorded(*w.record, prompt, np.asarray(s.token_ids, np.int32),
                                                                   np.asarray(s.logprobs, np.float32)))
                if out.version is not None:  # an inflight target: which of its versions served this request
                    self.futures.timeline.note(w.request_id, "weights_version", out.version)
                    served = self.versions.setdefault(str(w.adapter), {})
                    served[out.version] = served.get(out.version, 0) + 1
                lps = R.last_n(out.prompt_logprobs, w.last_n)
                fill = (functools.partial(fill_response, scores=cut_before(out.scores, w.last_n), targets=w.targets)
                        if out.scores is not None else None)
                self._finish(w.request_id, Outcome("proto", sample_output(out.samples, lps, fill), "SampleResponse"))
        return False

    async def _one_by_one(self, sampler: Any, name: str, groups: Groups, owner: str) -> bool:
        """A shared call failed: each of its requests again, alone, so a request that fails the sampler
        fails by itself and the other users' requests in its batch are served (the checks at submit
        should leave nothing that fails; this is the guard for what they missed)."""
        self.split_batches += 1
        for key, ws in groups.items():
            for w in ws:
                if await self._run(sampler, name, {key: [w]}, owner):
                    return True
        return False

    def _fail(self, groups: Groups, why: str) -> None:
        for ws in groups.values():
            for w in ws:
                self._finish(w.request_id, Outcome.error(why, "server"))

    def _finish(self, request_id: str, outcome: Outcome) -> None:
        self.live.discard(request_id)
        self.futures.finish(request_id, outcome)  # a cancelled request is finished already: this is a no-op

    def cancel(self, request_id: str) -> str:
        """Cancel a sampling request: ``waiting`` (taken out of its batch before any sampler saw it),
        ``running`` (in a sampler call: that call goes on for the requests beside it, and this one's result
        is dropped; a learner call with no request left uncancelled ends at its next token, so the user's
        next request does not wait for it) or ``finished`` (its result stays). Its promise fails as
        cancelled."""
        if request_id not in self.live:
            if self.futures.items[request_id].outcome is None:
                raise UserError("only sampling requests can be cancelled: a training request runs in its "
                                "client's seq_id order, which the next request depends on", 400)
            return "finished"
        state = "running"
        for base, queue in self.waiting.items():
            kept = [(o, w) for o, w in queue if w.request_id != request_id]
            state, self.waiting[base] = ("waiting" if len(kept) < len(queue) else state), kept
        for groups in self.learner_waiting.values():
            for key, ws in list(groups.items()):
                kept_ws = [w for w in ws if w.request_id != request_id]
                if len(kept_ws) < len(ws):
                    state = "waiting"
                    if kept_ws:
                        groups[key] = kept_ws
                    else:
                        del groups[key]
        for call, (learner, ids) in list(self.learner_calls.items()):
            if request_id in ids:
                ids.discard(request_id)
                if not ids:  # nobody waits for this learner call any more: it ends at its next token
                    learner.abort_sample.remote(call)
        self.cancelled[state] += 1
        self._finish(request_id, Outcome.error("cancelled by its client (cancel_future): the SDK abandoned the "
                                               "request (a timeout or a cancelled task)", "user"))
        return state
