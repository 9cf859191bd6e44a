"""Driver-side API: connect to a cluster, submit jobs, follow them.

    client = otray.connect()                      # RAY_ADDRESS / a local Ray
    job = client.submit("conf/arithmetic_grpo.yaml", overrides=["algo.steps=10"])
    job.wait()                                    # -> the final JobStatus (otray.records)
    job.metrics()                                 # -> list of metrics rows (keys: otray.metric_keys)
    page = job.metrics_after(-1)                  # follow a running job: page.rows, then metrics_after(page.cursor)

Configs are validated here, before anything reaches the cluster, so a bad key
fails at submit with the key named.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from otray import config as config_mod
from otray.placement import cluster_env
from otray.records import EpisodePage, JobStatus, MetricsPage
from otray.types import OtrayError


class JobFailedError(OtrayError, RuntimeError):
    """``JobHandle.wait(raise_on_failure=True)`` on a job that did not succeed."""


class ManagerGoneError(OtrayError, RuntimeError):
    """The cluster's ResourceManager stopped answering and did not come back within the client's wait."""


class JobHandle:
    """One job of the caller's: every call goes to the ResourceManager with the client's key."""

    def __init__(self, client: Client, job_id: str):
        self.client, self.id = client, job_id

    @property
    def _key(self) -> str | None:
        return self.client.api_key

    def status(self) -> JobStatus:
        return self.client.call(lambda rm: rm.status.remote(self.id, api_key=self._key))

    def metrics(self, since: int = 0) -> list[dict[str, Any]]:
        """The job's metrics rows from position ``since`` on (keys: :mod:`otray.metric_keys`). To follow a running
        job, use :meth:`metrics_after`: positions shift when a restart drops the rows past its checkpoint."""
        return self.client.call(lambda rm: rm.metrics.remote(self.id, since, api_key=self._key))

    def metrics_after(self, cursor: int = -1) -> MetricsPage:
        """The job's metrics rows written after ``cursor`` (-1: all), and the cursor to pass next: a follower sees
        every row once, the steps a restart runs again included."""
        return self.client.call(lambda rm: rm.metrics_after.remote(self.id, cursor, api_key=self._key))

    def cancel(self) -> JobStatus:
        return self.client.call(lambda rm: rm.cancel.remote(self.id, api_key=self._key))

    def episodes(self, step: int | None = None) -> EpisodePage:
        """The episodes the job logged at ``step`` (default: its latest)."""
        return self.client.call(lambda rm: rm.episodes.remote(self.id, step, api_key=self._key))

    def checkpoints(self) -> list[int]:
        return self.client.call(lambda rm: rm.checkpoints.remote(self.id, api_key=self._key))

    def outputs(self, page: int = 1000) -> list[dict[str, Any]]:
        """An inference job's output rows (one per episode or game), fetched through Ray from any node."""
        rows: list[dict[str, Any]] = []
        while True:
            got = self.client.call(lambda rm: rm.outputs.remote(self.id, len(rows), page, api_key=self._key))
            rows.extend(got)
            if len(got) < page:
                return rows

    def download_checkpoint(self, dest: str | Path, step: int | None = None) -> Path:
        """Fetch the job's checkpoint at ``step`` (default: latest) through Ray into ``dest``:
        ``dest/state`` (learner state) and ``dest/model`` (HF/PEFT model)."""
        from otray.checkpoints import unpack_dir

        _, blob = self.client.call(lambda rm: rm.checkpoint_blob.remote(self.id, step, api_key=self._key))
        return unpack_dir(blob, dest)

    def wait(self, timeout: float | None = None, poll_s: float = 0.5, raise_on_failure: bool = False) -> JobStatus:
        """Poll until the job ends; its final status (``raise_on_failure``: JobFailedError unless it succeeded)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status()
            if st.terminal:
                if raise_on_failure and not st.succeeded:
                    raise JobFailedError(f"job {self.id} ended {st.state.value}: {st.error}")
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} still {st.state.value} after {timeout} s")
            time.sleep(poll_s)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"


class Client:
    """A driver's view of the cluster's ResourceManager, with the caller's key. The manager restarts itself
    when its process dies (its jobs that were running end FAILED, ``ResourceManagerRestarted``); a call
    made meanwhile waits for it, up to ``manager_wait_s``, then raises :class:`ManagerGoneError`."""

    def __init__(self, rm: Any, api_key: str | None, manager_wait_s: float = 60.0):
        self.rm, self.api_key, self.manager_wait_s = rm, api_key, manager_wait_s

    def call(self, send: Callable[[Any], Any]) -> Any:
        """``send(the manager)``'s answer (an ObjectRef, waited for), through a restart of the manager."""
        import ray

        from otray.actors.control.resource_manager import NAME, NAMESPACE

        deadline = time.monotonic() + self.manager_wait_s
        while True:
            try:
                return ray.get(send(self.rm))
            except ray.exceptions.RayActorError as e:  # restarting (unavailable), or replaced by a new one
                if time.monotonic() > deadline:
                    raise ManagerGoneError(f"the ResourceManager stopped answering ({type(e).__name__}) and did not "
                                           f"come back in {self.manager_wait_s:g} s; see `ray status` and `otray "
                                           "status`, then resubmit") from None
                time.sleep(0.5)
                try:
                    self.rm = ray.get_actor(NAME, namespace=NAMESPACE)
                except ValueError:
                    pass  # none registered under its name yet

    def submit(self, config: str | Path | dict[str, Any] | config_mod.Config,
               overrides: list[str] | None = None) -> JobHandle:
        import ray

        cfg = config_mod.load(config, overrides)
        # an admin's relative job.output_dir counts from here, not from wherever the job lands
        job_id = ray.get(self.rm.submit.remote(config_mod.to_dict(cfg), api_key=self.api_key, cwd=os.getcwd()))
        return JobHandle(self, job_id)

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id)

    def jobs(self) -> list[JobStatus]:
        return self.call(lambda rm: rm.jobs.remote(api_key=self.api_key))

    def add_user(self, name: str, admin: bool = False) -> str:
        return self.call(lambda rm: rm.add_user.remote(name, admin, api_key=self.api_key))


def connect(address: str | None = None, api_key: str | None = None, *, db_path: str | None = None,
            auth_enabled: bool | None = None) -> Client:
    """Join the Ray cluster at ``address`` (default ``RAY_ADDRESS``, else start a local one)
    and find or start its ResourceManager."""
    import ray

    from otray.actors.control.resource_manager import get_or_create

    if not ray.is_initialized():
        # "local" when none is named: Ray would otherwise join the cluster a past `ray start` recorded in
        # /tmp/ray/ray_current_cluster, and hang for minutes when that one is gone (`--address auto` joins it)
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False, log_to_driver=False, namespace="otray",
                 **cluster_env(address, {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}))
    if auth_enabled is None:
        auth_enabled = os.environ.get("OTRAY_AUTH", "0") == "1"
    rm = get_or_create(db_path, auth_enabled=auth_enabled)  # db_path None: $OTRAY_DB or <otray home>/registry.db
    ray.get(rm.ping.remote())
    return Client(rm, api_key if api_key is not None else os.environ.get("OTRAY_API_KEY"))
