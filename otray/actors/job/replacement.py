"""WorkerReplacer: a policy's dead rollout workers replaced alone, each by a new one in its own bundle.

Runs in the job driver (``JobDriver``), inside :class:`~otray.actors.job.runtime.PolicyRuntime`. A worker that
died is dropped by its :class:`~otray.actors.sampling.fleet.RolloutFleet`; the replacer makes a new worker in
the dead one's placement-group bundle, gives it the learner's current weights (checked against their
checksum) and the dead one's RNG state after its last generate call (a share it lost is then drawn as it would
have been), and puts it in the fleet's slot, at most ``job.max_failures`` times in a job. It keeps what it did
for the driver: lines for the next health check (replacements made inside a generate call) and, for the
next step's ``recovery/workers`` row, why each worker was replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otray.actors.sampling.fleet import RolloutFleet


@dataclass
class WorkerReplacer:
    """Replaces the dead rollout workers of policy ``name`` (its ``fleet``, whose worker i sits in bundle
    ``first_bundle + i``) through ``factory``, ``limit`` at most, each given ``learner``'s weights as
    ``weight_sync`` sends them, in ``dtype``."""

    name: str
    factory: Any  # ActorFactory: .worker(first_bundle, i, prefix=...) makes rollout worker i in its bundle
    limit: int
    fleet: RolloutFleet
    learner: Any  # the policy's PolicyLearner actor handle
    first_bundle: int
    prefix: str  # its actors' role prefix
    weight_sync: str
    dtype: Any  # the workers' dtype (WorkerInfo.dtype)
    replaced: int = 0  # workers replaced so far in this job
    pending: list[str] = field(default_factory=list)  # lines of replacements made mid-step, for the next check
    healed: list[str] = field(default_factory=list)  # replacements since the last step's row, and why

    def take_pending(self) -> list[str]:
        """The lines of replacements made inside a generate call since the last health check."""
        lines, self.pending = self.pending, []
        return lines

    def take_healed(self) -> list[str]:
        """Why each worker replaced since the last step's row was replaced (that row's ``recovery/workers``)."""
        lines, self.healed = self.healed, []
        return lines

    def replace_dead(self) -> list[str]:
        """Each worker the fleet dropped, replaced by a new one in its bundle given the learner's current
        weights, while fewer than ``limit`` were; a line for each."""
        import ray

        from otray.actors.sampling.rollout import wait_ready

        lines, who = [], f"policy {self.name!r}: rollout worker"
        for i in sorted(self.fleet.dead):
            if self.replaced >= self.limit:
                return [*lines, f"{who} {i} not replaced ({self.replaced} replaced already, job.max_failures); "
                                "the others sample its share"]
            worker = self.factory.worker(self.first_bundle, i, prefix=self.prefix)
            try:  # the learner's weights now (the worker checks them against their checksum)
                wait_ready([worker])
                ray.get(worker.update_weights.remote(self.learner.weights.remote(self.weight_sync, self.dtype)))
                if i in self.fleet.rng:  # the dead one's RNG state after its last share (RolloutFleet.keep_rng)
                    ray.get(worker.set_rng_state.remote(self.fleet.rng[i]))
            except Exception as e:  # noqa: BLE001 - the others go on sampling its share
                ray.kill(worker)
                lines.append(f"{who} {i} could not be replaced ({type(e).__name__}: {e})")
                continue
            self.healed.append(f"{who} {i} replaced in its bundle ({self.fleet.dead[i]})")
            self.fleet.replace(i, worker)
            self.replaced += 1
            lines.append(f"{who} {i} replaced by a new one in its bundle")
        return lines
