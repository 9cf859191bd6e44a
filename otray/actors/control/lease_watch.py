"""Leases that end with the service holding them.

A lease (``ResourceManager.open_lease``) is work another service runs for a user: a Tinker training
client, held by the ``TinkerService`` actor. If that actor dies, nothing would close its leases (they
stayed RUNNING until the manager or the service restarted). :class:`LeaseWatch` keeps, per holder,
one call the holder never answers (``until_gone``); when the holder dies the call fails, and every
lease it held is marked FAILED at once with the reason and its token dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from otray.actors.control.gate import Gate
from otray.actors.control.registry import Registry
from otray.records import JobState

log = logging.getLogger(__name__)


class LeaseWatch:
    def __init__(self, registry: Registry, gate: Gate):
        self.registry, self.gate = registry, gate
        self.held: dict[str, set[str]] = {}  # holder id -> lease job ids
        self.tasks: dict[str, asyncio.Task] = {}  # holder id -> its watch (kept: the loop holds weak references)

    def add(self, holder: Any, holder_id: str, job_id: str) -> None:
        """Watch ``holder`` (an actor handle with an ``until_gone`` method) for lease ``job_id``."""
        first = holder_id not in self.held
        self.held.setdefault(holder_id, set()).add(job_id)
        if first:
            self.tasks[holder_id] = asyncio.get_running_loop().create_task(self._until_lost(holder, holder_id))

    async def _until_lost(self, holder: Any, holder_id: str) -> None:
        try:
            await holder.until_gone.remote()
            why = "it stopped"
        except Exception as e:  # noqa: BLE001 - the holder died (or was restarted): its state is gone
            why = f"it died ({type(e).__name__})"
        self.tasks.pop(holder_id, None)
        for job_id in self.held.pop(holder_id, set()):
            if not self.registry.job(job_id).state.terminal:
                self.registry.set_state(job_id, JobState.FAILED,
                                        f"the service holding this lease was lost: {why}; its live models are "
                                        "gone: load their last checkpoints with create_training_client_from_state")
                log.info("lease %s failed: its holder %s was lost", job_id, holder_id)
            self.gate.drop_job(job_id)
