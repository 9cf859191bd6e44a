"""RolloutFleet: routing generate calls over rollout worker actors, from the process that owns it.

A fleet holds Ray actor handles of rollout workers (or of a learner that samples,
``rollout.colocate``) and whatever it learned about them: which died, and why. It
splits a batch of prompts over the live workers, routes around a worker that died
(re-running its share on the others), pushes weight updates, and health-checks the
workers when asked (the job does between steps, and reports a worker it lost).

State stays in the process that owns the fleet: the job driver owns the fleets that
its agent loop samples from and that receive weight updates; a ProtocolCoordinator
actor is given worker *handles* and builds fleets of its own. A fleet object is never
shipped to another actor (its copy there would go stale).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from otray.types import ConfigError, GenerateResult, SamplingParams, WeightSyncError, WorkersLostError

log = logging.getLogger(__name__)


class RolloutFleet:
    """Manager of rollout worker actors, owned by the process that samples through it."""

    def __init__(self, workers: list[Any]):
        if not workers:
            raise ConfigError("a rollout fleet needs at least one worker (rollout.num_workers >= 1)")
        self.workers = list(workers)
        self.dead: dict[int, str] = {}  # worker index -> why it was dropped
        self.drops: list[tuple[int, str]] = []  # every drop so far, in order (a replaced worker may die again)
        # called when a generate call has lost every worker: True when it made some live again (the job's
        # PolicyRuntime replaces dead workers in their bundles); None: the call fails
        self.refill: Callable[[], bool] | None = None
        # with keep_rng (a job that replaces dead workers): each worker's RNG state after its last generate call,
        # which its replacement starts from, so it samples what the dead one would have (:meth:`generate`)
        self.keep_rng = False
        self.rng: dict[int, Any] = {}

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.workers)) if i not in self.dead]

    def health_check(self, timeout: float = 30.0) -> dict[int, bool]:
        """Ping every live worker; one that fails or does not answer within ``timeout`` is dropped.
        Returns worker index -> healthy (for the workers that were live)."""
        import ray

        refs = {i: self.workers[i].ping.remote() for i in self.live}
        status = {}
        for i, ref in refs.items():
            try:
                status[i] = bool(ray.get(ref, timeout=timeout))
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                self._drop(i, e)
                status[i] = False
        return status

    def replace(self, i: int, worker: Any) -> None:
        """Worker ``i`` (dropped) is ``worker`` from now on, a new actor in its place."""
        self.workers[i] = worker
        self.dead.pop(i, None)

    def _answers(self, i: int, timeout: float = 10.0) -> bool:
        """Whether worker ``i`` answers a ping: a task that failed with an actor's death may have failed
        on its *argument* (an ObjectRef whose producing actor died), with the worker itself alive."""
        import ray

        try:
            return bool(ray.get(self.workers[i].ping.remote(), timeout=timeout))
        except Exception:  # noqa: BLE001 - any failure means it does not answer
            return False

    def _drop(self, i: int, err: BaseException) -> None:
        first_line = (str(err).strip().splitlines() or [""])[0]
        self.dead[i] = f"{type(err).__name__}: {first_line}"[:300]
        self.drops.append((i, self.dead[i]))
        log.warning("rollout worker %d dropped: %s", i, err)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 images: list[Any] | None = None) -> list[GenerateResult]:
        """Split ``prompts`` (and their ``images``, a vision-language model's) over live workers; a failed
        share is re-run on the others. With ``keep_rng``, each worker's RNG state after its share is kept
        (one more actor call, queued behind the share): a fleet that lost its last worker re-runs the share on
        a replacement started from the dead one's state, and so draws what it would have (``benchmarks/chaos.py``:
        without it, a replaced worker's fresh RNG made the healed demo end 5.4 points from the undisturbed run)."""
        import ray

        results: list[GenerateResult | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            live = self.live
            if not live and self.refill is not None and self.refill():
                live = self.live
            if not live:
                raise WorkersLostError("every rollout worker failed: " +
                                   "; ".join(f"worker {i}: {why}" for i, why in self.dead.items()))
            shares = {w: pending[k::len(live)] for k, w in enumerate(live)}
            refs = {w: self.workers[w].generate.remote([prompts[j] for j in idx], params, n,
                                                       [images[j] for j in idx] if images else None)
                    for w, idx in shares.items() if idx}
            after = {w: self.workers[w].rng_state.remote() for w in refs} if self.keep_rng else {}
            pending = []
            for w, ref in refs.items():
                try:
                    for j, r in zip(shares[w], ray.get(ref)):
                        results[j] = r
                    if w in after:
                        self.rng[w] = ray.get(after[w])
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    self._drop(w, e)
                    if any(results[j] is None for j in shares[w]):  # (not when it died after its share)
                        pending.extend(shares[w])
        return results  # type: ignore[return-value]

    def ask(self, call: Callable[[Any], Any]) -> dict[int, Any]:
        """``call(worker)`` (an actor call's reference) for every live worker: worker index -> its answer; a
        worker that died meanwhile is dropped (and left out) instead of failing the caller."""
        import ray

        refs = {i: call(self.workers[i]) for i in self.live}
        answers = {}
        for i, ref in refs.items():
            try:
                answers[i] = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self._drop(i, e)
        return answers

    def busy_s(self) -> list[float]:
        """Each live worker's busy seconds so far (see ``otray.timing.BusyClock``)."""
        return list(self.ask(lambda w: w.busy_s.remote()).values())

    def update_weights(self, update_ref: Any, version: int | None = None, sender: Any = None) -> list[int]:
        """Push one weight update (an ObjectRef: its handle or tensors travel via the object store) to every
        live worker; ``sender``: a task that must run meanwhile (the learner's broadcast of the update).
        A worker that reports a version other than ``version``, or whose loaded weights fail the
        update's checksum, fails the sync naming it: sampling stale weights is never silent."""
        import ray

        refs = {i: self.workers[i].update_weights.remote(update_ref) for i in self.live}
        if sender is not None:
            ray.get(sender)
        versions = []
        for i, ref in refs.items():
            try:
                got = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if self._answers(i):  # the update's source (the learner) died, not this worker
                    raise
                self._drop(i, e)
                continue
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, WeightSyncError):
                    raise WeightSyncError(f"rollout worker {i}: {e.cause}") from None
                raise
            if version is not None and got != version:
                raise WeightSyncError(f"rollout worker {i} reports policy version {got} after the update to "
                                      f"version {version}: it did not apply the update")
            versions.append(got)
        if not versions and self.refill is not None and self.refill():  # new workers, given the learner's weights
            versions = [version] * len(self.live)
        if not versions:
            raise WorkersLostError("no rollout worker accepted the weight update: " +
                                   "; ".join(f"worker {i}: {why}" for i, why in self.dead.items()))
        return versions
