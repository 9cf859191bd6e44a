"""A training client's forward_backward and optim_step requests as the model's
:class:`~otray.tinker.service.futures.OrderedExecutor` runs them.

Each is a :class:`PassRun` or :class:`StepRun`: the learner call, then what the service records after it (the
replay log that heals a model, the lease's figures). When a forward_backward's turn comes with the optim_step
after it already queued (a client that submits its next step before awaiting the last, as tinker-cookbook's
supervised loop does, or any client whose requests queued behind a slow one), the two go to the learner as one
call (a :class:`~otray.tinker.learner.calls.PairCall`): one round trip instead of two, and each part still
answers, fails and is recorded as its own request would be. Small calls of several clients then travel to the
learner together (:mod:`otray.tinker.service.learner_calls`).

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional, Protocol

from otray.records import JobState
from otray.tinker.errors import UserError, unwrap
from otray.tinker.learner.calls import LearnerCall, PairCall, PassCall, StepCall
from otray.tinker.learner.loss_run import reduced
from otray.tinker.learner.passes import PassRequest
from otray.tinker.learner.specs import AdamStep
from otray.tinker.service.futures import Outcome, settle
from otray.tinker.service.healing import Pass, Step
from otray.tinker.service.leases import LeaseEnded, Leases
from otray.tinker.wire.messages import TrainCall, train_output


class Training(Protocol):
    """What a run needs of :class:`~otray.tinker.service.training.Training`, which owns the models' state."""

    leases: Leases

    async def _call(self, model_id: str, call: LearnerCall, check: asyncio.Future) -> Any: ...

    async def _ran(self, owner: str, model_id: str, call: Pass | Step) -> None: ...

    async def unload(self, model_id: str, why: str, state: JobState = JobState.SUCCEEDED) -> None: ...


def request(c: TrainCall) -> PassRequest:
    """What the learner runs of forward(_backward) call ``c``."""
    return PassRequest(c.model_id, c.datums, c.loss_fn, c.loss_fn_config, not c.forward_only, c.graph)


class PassRun:
    """A forward(_backward) request of ``owner``'s model (``check``: its lease check, started as it arrived)."""

    def __init__(self, training: Training, owner: str, call: TrainCall, check: asyncio.Future):
        self.training, self.owner, self.call, self.check = training, owner, call, check

    async def __call__(self) -> Outcome:
        c = self.call
        try:
            res: Any = await self.training._call(c.model_id, PassCall(self.owner, request(c)), self.check)
        except Exception as e:  # noqa: BLE001 - answered by after()
            res = e
        return await self.after(res)

    def with_next(self, run: Any) -> Optional[Callable[[], Awaitable[tuple[Outcome, Outcome]]]]:
        """The pair's run when ``run`` (the model's next request) is an optim_step this forward_backward leads."""
        if self.call.forward_only or not isinstance(run, StepRun) or run.model_id != self.call.model_id:
            return None
        return lambda: pass_and_step(self, run)

    async def after(self, res: Any) -> Outcome:
        """The request's answer from the learner's (a PassResult, or the exception the call raised), recorded."""
        c = self.call
        if isinstance(res, BaseException):  # a custom loss failing on this data: the caller's error, not the service's
            if isinstance(unwrap(res), UserError):
                raise unwrap(res) from None
            raise res
        if not c.forward_only:
            await self.training._ran(self.owner, c.model_id, Pass(c.datums, c.loss_fn, c.loss_fn_config, c.graph))
            self.training.leases.note_pass(c.model_id, res.loss_sum, sum(len(lp) for lp in res.logprobs))
        k = c.datums[0].target_k and len(c.datums[0].target_k[0])
        return Outcome("proto", train_output(res.logprobs, res.losses, res.loss_sum, k or None,
                                             reduced(res.metric_sums, len(c.datums))), "ForwardBackwardOutput")


class StepRun:
    """An optim_step request of ``owner``'s model ``model_id``."""

    def __init__(self, training: Training, owner: str, model_id: str, step: AdamStep, check: asyncio.Future):
        self.training, self.owner, self.model_id, self.step, self.check = training, owner, model_id, step, check

    async def __call__(self) -> Outcome:
        metrics = await self.training._call(self.model_id, StepCall(self.owner, self.model_id, self.step), self.check)
        return await self.after(metrics)

    async def after(self, metrics: Any) -> Outcome:
        if isinstance(metrics, BaseException):
            raise metrics
        t = self.training
        await t._ran(self.owner, self.model_id, Step(self.step))
        try:
            await t.leases.report_step(self.model_id, self.step.learning_rate)
        except LeaseEnded as e:  # cancelled: this step stands, the model goes
            await t.unload(self.model_id, str(e), JobState.CANCELLED)
        return Outcome("json", {"metrics": metrics, "type": "optim_step"})


async def pass_and_step(p: PassRun, s: StepRun) -> tuple[Outcome, Outcome]:
    """``p`` and the ``s`` after it in one learner call, once both lease checks passed (else each alone: the
    step's own run then answers its refusal); each answered and recorded in order, as two calls would be."""
    try:
        await asyncio.shield(s.check)
    except Exception:  # noqa: BLE001 - answered by the step's own run
        return await settle(p), await settle(s)
    c = p.call
    got = await p.training._call(c.model_id, PairCall(PassCall(p.owner, request(c)), s.step), p.check)
    return await settle(lambda: p.after(got.forward_backward)), await settle(lambda: s.after(got.optim_step))
