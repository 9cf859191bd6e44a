"""The ResourceManager's job queue: fair placement, starting drivers, watching them to the end.

Jobs wait in ``queue`` until their placement group (``otray.actors.control.lease.bundles_for``) can
be placed. The next job to place is the oldest queued job of the user who holds the fewest
running jobs (:func:`fair_pick`), so a user who queued many jobs takes turns with one who queued
one; once its placement group is asked for it blocks the rest until it is placed (no job jumps
a larger one that waits for room). A started job's driver gets its
job token from the :class:`~otray.actors.control.gate.Gate`; its end (success, failure, cancel,
driver death) frees the placement group and stores the innermost error (:func:`job_error`).

Healing (``job.max_failures``): a running job that fails because one of its actors died (a rollout
worker, a learner, the driver itself: :func:`healable`) is restarted in the placement group it holds,
from its last checkpoint (``JOB_ID:STEP``, restored as a manual resume restores it: weights, optimizer,
data position, RNG), with a new job token (the dead driver's late reports are refused). The rows and
episodes it had reported after that step are forgotten (it runs them again: no duplicates) and a
``recovery`` row records the failure. Past ``max_failures`` the job ends FAILED naming every failure.
Runs on the ResourceManager's event loop; the manager owns the one instance.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from pathlib import Path
from typing import Any

import ray

from otray import config as config_mod
from otray.actors.control.gate import Gate
from otray.actors.control.lease import JobDriver, bundles_for, placed, placement_wait
from otray.actors.control.registry import JobState, Registry

POLL_S = 0.2
# a job's failure that a restart can heal: one of its actors (or their processes, or their node) died
HEALABLE = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "OwnerDiedError",
            "ObjectLostError", "NodeDiedError", "OutOfMemoryError", "LocalRayletDiedError", "WorkersLostError")


class JobQueue:
    def __init__(self, registry: Registry, gate: Gate, output_dir: str):
        self.registry, self.gate, self.output_dir = registry, gate, output_dir
        self.queue: deque[str] = deque()
        self.pending: dict[str, Any] = {}  # job id -> placement group not yet placed
        self.running: dict[str, tuple[Any, Any]] = {}  # job id -> (driver actor, placement group)
        self.failures: dict[str, list[str]] = {}  # job id -> the failures healed so far (their errors)
        self._scheduler: asyncio.Task | None = None
        for job in registry.jobs():  # what a restarted manager finds
            if job.state is JobState.QUEUED:
                self.queue.append(job.id)
            elif job.state in (JobState.STARTING, JobState.RUNNING):
                registry.set_state(job.id, JobState.FAILED, "ResourceManagerRestarted: the resource manager "
                                   "restarted while the job ran; resume it from its last checkpoint")
                _remove_placement_group(job.id)  # its driver died with the old manager; its lease goes too

    def add(self, job_id: str) -> None:
        self.queue.append(job_id)
        self.kick()

    def cancel(self, job_id: str) -> None:
        """Mark the job CANCELLED and free what it holds (queue slot, placement group, driver)."""
        if job_id in self.queue:
            self.queue.remove(job_id)
        pg = self.pending.pop(job_id, None)
        if pg is not None:
            ray.util.remove_placement_group(pg)
        self.registry.set_state(job_id, JobState.CANCELLED)
        if job_id in self.running:
            actor, pg = self.running.pop(job_id)
            ray.kill(actor)  # its learner and workers are owned by it and die with it
            ray.util.remove_placement_group(pg)
        self.gate.drop_job(job_id)
        self.kick()

    def placement_group(self, job_id: str) -> Any:
        pair = self.running.get(job_id)
        return pair[1] if pair else self.pending.get(job_id)

    def kick(self) -> None:
        if self.queue and (self._scheduler is None or self._scheduler.done()):
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def _schedule(self) -> None:
        """Place queued jobs one at a time (:meth:`_head`); each waits until its placement group fits.
        A job that cannot be placed at all (its stored config no longer loads, Ray refuses its placement
        group) ends FAILED with the reason, and the queue goes on: nothing else waits behind it forever."""
        while self.queue:
            job_id = self._head()
            try:
                await self._place(job_id)
            except Exception as e:  # noqa: BLE001 - one job's failure, not the queue's
                if job_id in self.queue:
                    self.queue.remove(job_id)
                pg = self.pending.pop(job_id, None)
                if pg is not None:
                    ray.util.remove_placement_group(pg)
                if not self.registry.job(job_id).state.terminal:
                    self.registry.set_state(job_id, JobState.FAILED, f"SchedulerError: the job could not be placed: "
                                                                     f"{job_error(e)}")

    async def _place(self, job_id: str) -> None:
        """Ask for ``job_id``'s placement group, wait until Ray places it, start the job."""
        from ray.util.placement_group import placement_group

        cfg = config_mod.load(self.registry.job(job_id).config)
        pg = self.pending.get(job_id) or placement_group(bundles_for(cfg), strategy=cfg.resources.strategy,
                                                         name=pg_name(job_id))
        self.pending[job_id] = pg
        await placed(pg, lambda: job_id in self.pending, POLL_S)  # False: cancelled while waiting
        if self.pending.pop(job_id, None) is None or job_id not in self.queue:
            return
        self.queue.remove(job_id)
        await self._start(job_id, cfg, pg)

    def waiting(self, job_id: str) -> str | None:
        """Why a queued job has not started (None: it is not queued): the job placed before it, or what
        its placement group waits for (:func:`~otray.actors.control.lease.placement_wait`)."""
        if job_id not in self.queue:
            return None
        pg = self.pending.get(job_id)
        if pg is None:
            ahead = next((j for j in self.queue if j in self.pending), None)
            return (f"behind job {ahead}, which is being placed (jobs are placed one at a time)" if ahead
                    else "next to be placed")
        try:
            return placement_wait(pg)
        except Exception as e:  # noqa: BLE001 - a status call must not fail for want of a reason
            return f"its placement group is not placed yet (why could not be read: {job_error(e)})"

    def _head(self) -> str:
        """The job being placed (its placement group asked for), else the fair pick of the queue."""
        asked = next((j for j in self.queue if j in self.pending), None)
        if asked is not None:
            return asked
        return fair_pick([(j, self.registry.job(j).owner) for j in self.queue],
                         [self.registry.job(j).owner for j in self.running])

    async def _start(self, job_id: str, cfg: config_mod.Config, pg: Any, restart: bool = False) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not restart:
            self.registry.set_state(job_id, JobState.STARTING)
        job_dir = str(Path(cfg.job.output_dir if cfg.job.output_dir != "runs" else self.output_dir).absolute() / job_id)
        driver = JobDriver.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote(config_mod.to_dict(cfg), job_dir, job_id,
                                                        self.gate.job_token(job_id))
        self.running[job_id] = (driver, pg)
        try:
            await driver.ping.remote()
        except Exception as e:  # noqa: BLE001
            return self._finish(job_id, JobState.FAILED, f"JobDriverStartError: the job driver failed to start: "
                                                         f"{job_error(e)}")
        if not restart:
            self.registry.set_state(job_id, JobState.RUNNING)
        asyncio.get_running_loop().create_task(self._watch(job_id, driver.run.remote()))

    async def _watch(self, job_id: str, ref: Any) -> None:
        try:
            await ref
        except Exception as e:  # noqa: BLE001 - any failure ends the job as FAILED, unless a restart heals it
            if self.registry.job(job_id).state is JobState.CANCELLED or job_id not in self.running:
                return
            error = job_error(e)
            if not await self._heal(job_id, error):
                earlier = self.failures.pop(job_id, [])
                self._finish(job_id, JobState.FAILED, error + "".join(
                    f"; earlier failure {k} (healed by a restart): {why}" for k, why in enumerate(earlier, 1)))
            return
        self.failures.pop(job_id, None)
        self._finish(job_id, JobState.SUCCEEDED, None)

    async def _heal(self, job_id: str, error: str) -> bool:
        """Restart a job that failed with ``error`` from its last checkpoint, in its placement group, if the
        failure is :func:`healable` and the job has restarts left (``job.max_failures``); False otherwise."""
        from otray import metric_keys as K

        cfg = config_mod.load(self.registry.job(job_id).config)
        healed = self.failures.setdefault(job_id, [])
        if not healable(error) or len(healed) >= cfg.job.max_failures:
            return False
        healed.append(error)
        driver, pg = self.running[job_id]
        ray.kill(driver)  # its learners and workers die with it: their bundles free up for the new ones
        try:
            step: int | None = self.registry.checkpoint(job_id)[0]
        except KeyError:
            step = None  # none saved yet: from the start (or from the checkpoint it was submitted to resume)
        self.registry.rewind(job_id, step or 0)
        self.registry.set_progress(job_id, {K.STEP: step or 0, K.PHASE: K.PHASE_RECOVERY, K.RECOVERY_FAILURE: len(healed),
                                            K.RECOVERY_REASON: error[:500], K.RECOVERY_FROM: step})
        if step is not None:
            cfg.checkpoint.resume_from = f"{job_id}:{step}"
        await self._start(job_id, cfg, pg, restart=True)
        return True

    def _finish(self, job_id: str, state: JobState, error: str | None) -> None:
        pair = self.running.pop(job_id, None)  # (its token stays: reports it sent last may still be queued)
        if pair is not None:
            ray.kill(pair[0])  # the driver and the actors it owns go now, not when Ray frees the group
            ray.util.remove_placement_group(pair[1])
        if not self.registry.job(job_id).state.terminal:
            self.registry.set_state(job_id, state, error)
        self.kick()


def healable(error: str) -> bool:
    """Whether a job's stored ``error`` (``Type: message``) is an actor's death a restart can heal (one of
    :data:`HEALABLE`, or a sharded learner whose rank died of one; not a failing environment or bad input)."""
    kind = error.split(":", 1)[0]
    return kind in HEALABLE or (kind == "LearnerGroupError" and any(f"{h}:" in error for h in HEALABLE))


def fair_pick(queued: list[tuple[str, str]], running_owners: list[str]) -> str:
    """The job to place next, of ``queued`` ((job id, owner) in submit order): the oldest job of the user
    who holds the fewest running or starting jobs (``running_owners``: one owner per such job), ties to
    the older job. Each user's own jobs start in the order they were submitted."""
    held = Counter(running_owners)
    first: dict[str, tuple[int, int, str]] = {}
    for i, (job_id, owner) in enumerate(queued):
        first.setdefault(owner, (held[owner], i, job_id))
    return min(first.values())[2]


def pg_name(job_id: str) -> str:
    """A job's placement group is named after it, so a restarted manager can find and free it."""
    return f"otray-job-{job_id}"


def _remove_placement_group(job_id: str) -> None:
    from ray.util.placement_group import get_placement_group

    try:
        ray.util.remove_placement_group(get_placement_group(pg_name(job_id)))
    except Exception:  # noqa: BLE001 - none by that name (never placed, or already removed)
        pass


def job_error(e: BaseException, limit: int = 2000) -> str:
    """``Type: message`` of the innermost exception of a Ray error chain (a job's stored error)."""
    while getattr(e, "cause", None) is not None and e.cause is not e:  # RayTaskError wraps the real one
        e = e.cause
    text = str(e).strip()
    if type(e).__name__.startswith("RayTaskError") or text.startswith("ray::"):
        text = "\n".join(ln for ln in text.splitlines()[1:] if ln.strip()) or text  # drop the "ray::X.run()" line
    return f"{type(e).__name__}: {text}"[:limit]
