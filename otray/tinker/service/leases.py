"""Tinker training clients as ResourceManager leases: each live model is an ``otray jobs`` row.

A training client (``create_model`` or create-via-load) opens a lease with the caller's own key,
so the ResourceManager records it as a RUNNING job of kind ``tinker`` owned by that user; every
``optim_step`` reports a progress row (step, last loss, tokens); the lease ends SUCCEEDED when the
client's session closes or expires, FAILED when the service restarts (the live adapter is gone;
the run's checkpoints stay), FAILED at once when the service actor dies (the manager watches it:
:mod:`otray.actors.control.lease_watch`). ``otray jobs cancel`` (the owner or an admin) drops the lease's
token: the service's next report fails, and the model is unloaded, so the client's next call is
a user error that says so.

The open leases' (job id, token) pairs are kept in the service's SQLite store, so a restarted
service can close those its predecessor left open. A request asks the manager whether its lease holds only when
a job token was dropped since it last said so (:mod:`otray.actors.control.epochs`): a cancel is still seen at
the very next request.

Runs in the TinkerService actor."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from otray import metric_keys as K
from otray.actors.control.epochs import LEASES, EpochCache
from otray.records import JobState
from otray.tinker.service.store import Store

log = logging.getLogger(__name__)
KIND = "tinker"


class LeaseEnded(Exception):
    """The lease was cancelled (``otray jobs cancel``) or its ResourceManager restarted."""


@dataclass(frozen=True)
class LeaseSpec:
    """What the ResourceManager records for a training client (the job's ``tinker`` section)."""
    model_id: str
    base_model: str
    rank: int
    session_id: str


@dataclass
class _Progress:
    step: int = 0
    loss: Optional[float] = None
    tokens: int = 0
    recoveries: int = 0  # learner deaths the model was rebuilt after


class Leases:
    """``holder``: the service's own actor handle and id; the manager fails its leases at once if it dies."""

    def __init__(self, store: Store, rm: Any, holder: tuple[Any, str] = (None, "")):
        self.store, self.rm, self.holder = store, rm, holder
        self.progress: dict[str, _Progress] = {}
        self.inherited = set(store.leases())  # open when this service started: its predecessor's (their models died)
        self.checked = EpochCache(LEASES)  # (job id, token) -> True: the manager's answers that a lease holds

    async def open(self, spec: LeaseSpec, api_key: Optional[str]) -> str:
        """Open the lease for a new live model; returns its job id."""
        job_id, token = await self.rm.open_lease.remote(KIND, spec.model_id, vars(spec), api_key, *self.holder)
        self.store.add_lease(spec.model_id, job_id, token)
        self.progress[spec.model_id] = _Progress()
        return job_id

    def note_pass(self, model_id: str, loss_sum: float, tokens: int) -> None:
        """A forward_backward's loss (sum over its weighted tokens) for the next progress row."""
        p = self.progress.setdefault(model_id, _Progress())
        p.loss, p.tokens = (loss_sum / tokens if tokens else loss_sum), p.tokens + tokens

    async def check(self, model_id: str) -> None:
        """Raises LeaseEnded when the model's lease was cancelled; a manager that does not answer
        (restarting) is not a cancel, and the request goes on."""
        held = self.store.leases().get(model_id)
        if held is None:
            return
        async def holds() -> bool:
            await self.rm.check_lease.remote(held[0], held[1])
            return True

        try:  # a lease the manager said holds holds while no job token was dropped since
            await self.checked.answer(held, holds)
        except Exception as e:  # noqa: BLE001 - AuthError: the token was dropped
            if isinstance(_cause(e), PermissionError):
                self._ended(model_id, held[0])

    def _ended(self, model_id: str, job_id: str) -> None:
        self.store.drop_lease(model_id)
        raise LeaseEnded(f"training client {model_id}'s lease {job_id} ended (cancelled with `otray jobs cancel`, "
                         "or the ResourceManager restarted): load its last checkpoint with "
                         "create_training_client_from_state")

    async def report_step(self, model_id: str, lr: float) -> None:
        """One optim_step done: a progress row. Raises LeaseEnded when the lease is gone."""
        def row(p: _Progress) -> dict:
            p.step += 1
            return {K.STEP: p.step, K.LOSS: p.loss, "tokens": p.tokens, "learning_rate": lr, K.PHASE: K.PHASE_TINKER}

        await self._report(model_id, row, "progress", ends=True)

    async def recovered(self, model_id: str, why: str) -> None:
        """The model's learner died and the model was rebuilt: a ``recovery`` row (``otray status`` lists it)."""
        def row(p: _Progress) -> dict:
            p.recoveries += 1
            return {K.STEP: p.step, K.PHASE: K.PHASE_RECOVERY, K.RECOVERY_FAILURE: p.recoveries,
                    K.RECOVERY_REASON: why, K.RECOVERY_FROM: p.step}

        await self._report(model_id, row, "recovery", ends=False)

    async def _report(self, model_id: str, row: Callable[[_Progress], dict], what: str, ends: bool) -> None:
        """A row of the lease's job (``row`` makes it from the model's progress); with ``ends``, a dropped
        token (cancelled) raises LeaseEnded; otherwise (the manager restarting) the row is lost, not the call."""
        held = self.store.leases().get(model_id)
        if held is None:
            return
        made = row(self.progress.setdefault(model_id, _Progress()))
        try:
            await self.rm.report.remote(held[0], made, held[1])
        except Exception as e:  # noqa: BLE001 - AuthError: the token was dropped
            if ends and isinstance(_cause(e), PermissionError):
                self._ended(model_id, held[0])
            log.warning("%s row of %s not recorded: %s", what, model_id, type(_cause(e)).__name__)

    async def close(self, model_id: str, state: JobState = JobState.SUCCEEDED, error: Optional[str] = None) -> None:
        held = self.store.leases().get(model_id)
        self.progress.pop(model_id, None)
        if held is None:
            return
        self.store.drop_lease(model_id)
        try:
            await self.rm.close_lease.remote(held[0], state, error, held[1])
        except Exception as e:  # noqa: BLE001 - already cancelled, or the manager is gone
            log.info("lease %s of %s was already closed: %s", held[0], model_id, type(_cause(e)).__name__)

    async def close_inherited(self, state: JobState, error: str) -> None:
        """Close the leases a restarted service's predecessor left open (those in the store when this one
        started; never one this service opened since: a client whose session outlived the restart may have
        made a new model before the first call that recovers)."""
        inherited, self.inherited = self.inherited, set()
        for model_id in sorted(inherited):
            await self.close(model_id, state, error)


def _cause(e: BaseException) -> BaseException:
    inner = getattr(e, "cause", None)
    return inner if isinstance(inner, BaseException) else e
