"""A training client's forward_backward and optim_step requests as the model's
:class:`~otray.tinker.service.futures.OrderedExecutor` runs them.

Each is a :class:`PassRun` or :class:`StepRun`: the learner call, handed over in the model's order
(:mod:`otray.tinker.service.handover`: it may go while the call before it is still on the learner), then, in
order again, what the service records after it (the replay log that heals a model, the lease's figures). When a
forward_backward's turn comes with the optim_step after it already queued (a client that submits its next step
before awaiting the last, as tinker-cookbook's supervised loop does, or any client whose requests queued behind
a slow one), the two go to the learner as one call (a :class:`PairRun`, a
:class:`~otray.tinker.learner.calls.PairCall`): one round trip instead of two, and each part still answers, fails
and is recorded as its own request would be. Small calls of several clients then travel to the learner together
(:mod:`otray.tinker.service.learner_calls`).

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence, Union

from otray.records import JobState
from otray.tinker.errors import UserError, unwrap
from otray.tinker.learner.calls import LearnerCall, PairCall, PassCall, StepCall
from otray.tinker.learner.loss_run import reduced
from otray.tinker.learner.passes import PassRequest
from otray.tinker.learner.specs import AdamStep
from otray.tinker.service.futures import Outcome, raising, settle
from otray.tinker.service.handover import Handover, Sent
from otray.tinker.service.healing import Pass, Step
from otray.tinker.service.leases import LeaseEnded, Leases
from otray.tinker.wire.messages import TrainCall, train_output

Logged = tuple[Union[Pass, Step], int]  # a call as the replay log records it, with its size (Healing.size)


class Training(Protocol):
    """What a run needs of :class:`~otray.tinker.service.training.Training`, which owns the models' state."""

    leases: Leases
    handover: Handover

    def logged(self, call: Union[Pass, Step]) -> Logged: ...

    async def _ran(self, owner: str, model_id: str, call: Logged) -> None: ...

    async def unload(self, model_id: str, why: str, state: JobState = JobState.SUCCEEDED) -> None: ...


def request(c: TrainCall) -> PassRequest:
    """What the learner runs of forward(_backward) call ``c``."""
    return PassRequest(c.model_id, c.datums, c.loss_fn, c.loss_fn_config, not c.forward_only, c.graph)


def handed(ahead: Sequence[Any]) -> list[Sent]:
    """The calls the runs ``ahead`` handed over."""
    return [s for run in ahead for s in run.sent]


class _Run:
    """What every training run shares: ``logs`` (what its answer adds to the model's replay log), ``sent`` (its
    learner call once handed over), and the executor's two parts, :meth:`may_follow` and :meth:`send`."""

    training: Training
    model_id: str
    logs: list[Logged]
    sent: list[Sent]
    check: asyncio.Future  # its lease check, started as it arrived

    def may_follow(self, ahead: Sequence[Any]) -> bool:
        """Whether its call may be handed over while the runs ``ahead`` are unanswered."""
        return self.training.handover.may_follow(self.model_id, [c for run in ahead for c in run.logs])

    def learner_call(self) -> LearnerCall:
        raise NotImplementedError

    async def after(self, res: Any) -> Any:
        """The request's answer from the learner's (or the exception the call raised), recorded."""
        raise NotImplementedError

    async def send(self, ahead: Sequence[Any]) -> Callable[[], Awaitable[Any]]:
        """Its learner call handed over, behind the runs ``ahead``; returns what answers it."""
        sent = await self.training.handover.hand(self.model_id, self.learner_call(), self.check, handed(ahead))
        self.sent = [sent]
        return lambda: self.answer(sent)

    async def answer(self, sent: Sent) -> Any:
        try:
            res: Any = await self.training.handover.answer(sent)
        except Exception as e:  # noqa: BLE001 - answered by after()
            res = e
        return await self.after(res)

    async def __call__(self) -> Any:
        """The run alone: sent, then answered."""
        return await (await self.send(()))()


class PassRun(_Run):
    """A forward(_backward) request of ``owner``'s model (``check``: its lease check, started as it arrived)."""

    def __init__(self, training: Training, owner: str, call: TrainCall, check: asyncio.Future):
        self.training, self.owner, self.call, self.check = training, owner, call, check
        self.model_id, self.sent = call.model_id, []
        self.leads = not call.forward_only  # an optim_step after it goes with it (with_next)
        self.logs = [] if call.forward_only else [training.logged(Pass(call.datums, call.loss_fn, call.loss_fn_config,
                                                                          call.graph))]

    def learner_call(self) -> PassCall:
        return PassCall(self.owner, request(self.call))

    def with_next(self, run: Any) -> Optional["PairRun"]:
        """The pair's run when ``run`` (the model's next request) is an optim_step this forward_backward leads."""
        if self.call.forward_only or not isinstance(run, StepRun) or run.model_id != self.model_id:
            return None
        return PairRun(self, run)

    async def after(self, res: Any) -> Outcome:
        """The request's answer from the learner's (a PassResult, or the exception the call raised), recorded."""
        c = self.call
        if isinstance(res, BaseException):  # a custom loss failing on this data: the caller's error, not the service's
            if isinstance(unwrap(res), UserError):
                raise unwrap(res) from None
            raise res
        if not c.forward_only:
            await self.training._ran(self.owner, c.model_id, self.logs[0])
            self.training.leases.note_pass(c.model_id, res.loss_sum, sum(len(lp) for lp in res.logprobs))
        k = c.datums[0].target_k and len(c.datums[0].target_k[0])
        return Outcome("proto", train_output(res.logprobs, res.losses, res.loss_sum, k or None,
                                             reduced(res.metric_sums, len(c.datums))), "ForwardBackwardOutput")


class StepRun(_Run):
    """An optim_step request of ``owner``'s model ``model_id``."""

    def __init__(self, training: Training, owner: str, model_id: str, step: AdamStep, check: asyncio.Future):
        self.training, self.owner, self.model_id, self.step, self.check = training, owner, model_id, step, check
        self.logs, self.sent = [training.logged(Step(step))], []

    def learner_call(self) -> StepCall:
        return StepCall(self.owner, self.model_id, self.step)

    async def after(self, metrics: Any) -> Outcome:
        if isinstance(metrics, BaseException):
            raise metrics
        t = self.training
        await t._ran(self.owner, self.model_id, self.logs[0])
        try:
            await t.leases.report_step(self.model_id, self.step.learning_rate)
        except LeaseEnded as e:  # cancelled: this step stands, the model goes
            await t.unload(self.model_id, str(e), JobState.CANCELLED)
        return Outcome("json", {"metrics": metrics, "type": "optim_step"})


class PairRun(_Run):
    """``p`` and the optim_step ``s`` after it in one learner call, once both lease checks passed (else each
    alone: the step's own run then answers its refusal); each answered and recorded in order, as two calls
    would be."""

    def __init__(self, p: PassRun, s: StepRun):
        self.p, self.s, self.training, self.model_id, self.check = p, s, p.training, p.model_id, p.check
        self.logs, self.sent = p.logs + s.logs, []

    async def send(self, ahead: Sequence[Any]) -> Callable[[], Awaitable[tuple[Outcome, Outcome]]]:
        p, s = self.p, self.s
        try:
            await asyncio.shield(s.check)
        except Exception:  # noqa: BLE001 - answered by the step's own run
            try:
                first = await p.send(ahead)
            except Exception as e:  # noqa: BLE001 - its refusal
                first = raising(e)
            self.sent = p.sent

            async def alone() -> tuple[Outcome, Outcome]:
                return await settle(first), await settle(s)
            return alone
        return await super().send(ahead)

    def learner_call(self) -> PairCall:
        return PairCall(self.p.learner_call(), self.s.step)

    async def answer(self, sent: Sent) -> tuple[Outcome, Outcome]:
        got = await self.training.handover.answer(sent)  # raised: both requests fail with it (settle_pair)
        return await settle(lambda: self.p.after(got.forward_backward)), await settle(lambda: self.s.after(got.optim_step))

