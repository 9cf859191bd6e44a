"""ResourceManager: the named, detached actor that owns jobs and their leases.

Jobs wait in a queue (turns by user: ``otray.actors.control.scheduler``) until their placement group
(``otray.actors.control.lease``) can be placed; a job that can never fit the cluster is rejected at submit with the missing
resource named. The lease is released on every exit path: success, failure, cancel,
job actor death.

Every method names its caller (``otray.actors.control.gate``): a user's API key, a job's token
(the driver's reports and checkpoints), or a checkpoint grant (Serve replicas). A
non-admin's config is confined at submit (``otray.trust``).

The registry (SQLite, at ``<otray home>/registry.db`` unless told otherwise) is the
source of truth: the manager restarts itself when it dies (``max_restarts``) and reads
it back; jobs that were queued are queued again, jobs that were starting or running are
marked FAILED at once (their actors died with it, and so did their placement groups).

Start or find it with :func:`get_or_create`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import ray

from otray import config as config_mod
from otray import metric_keys as K
from otray import trust
from otray.actors.control.checkpoint_store import CheckpointStore
from otray.checkpoints import pin_refs, registered_refs
from otray.names import parse_ref
from otray.actors.control.gate import Gate
from otray.actors.control.lease_watch import LeaseWatch
from otray.actors.control.lease import NAME, NAMESPACE, JobDriver, bundles_for, missing_resources  # noqa: F401 (re-exported)
from otray.actors.control.registry import AuthError, JobRecord, Registry
from otray.actors.control.scheduler import JobQueue, job_error  # noqa: F401 (re-exported)
from otray.records import EpisodePage, Identity, JobState, JobStatus, MetricsPage, ServableJob, UserInfo
from otray.types import ConfigError

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=64)
class ResourceManager:
    """The cluster's one control-plane actor (named, detached, restarted by Ray): users and keys (the
    ``Gate``), the job queue that leases each job a placement group and starts its JobDriver
    (``JobQueue``), the Tinker leases (``LeaseWatch``), the SQLite ``Registry`` of jobs, metrics, episodes
    and checkpoints, and the ``CheckpointStore``. Every public method checks its caller's key or job
    token first; a restarted manager fails the jobs it lost and picks its queue up again."""

    def __init__(self, db_path: str, *, auth_enabled: bool = False, output_dir: str = "runs",
                 store_dir: str | None = None):
        self.registry = Registry(db_path)
        self.gate = Gate(self.registry, auth_enabled)
        self.store = CheckpointStore(store_dir or Path(db_path).parent / "checkpoints")
        self.users_root = Path(db_path).parent / "users"  # users' own areas: <users_root>/<name>/{runs,data}
        self.jobs_ = JobQueue(self.registry, self.gate, output_dir)
        self.lease_watch = LeaseWatch(self.registry, self.gate)

    async def ping(self) -> bool:
        self.jobs_.kick()  # a restarted manager picks its queue up again
        return True

    # ------------------------------------------------------------------ users' API (api_key)

    async def submit(self, cfg_dict: dict[str, Any], api_key: str | None = None, cwd: str | None = None) -> str:
        """Queue a job for the key's user; a non-admin's config is confined first (``otray.trust``).
        ``cwd``: the submitter's directory, against which an admin's relative ``job.output_dir`` counts."""
        caller = self.gate.caller(api_key)
        self.gate.check_job_quota(caller.name, sum(1 for j in self.registry.jobs(caller.name)
                                                   if not j.state.terminal and j.config.get("job", {}).get("kind") != "tinker"))
        area = self.users_root / caller.name
        cfg = trust.confine(config_mod.load(cfg_dict), caller, self.gate.allowed_modules(), area, self.gate.allowed_urls())
        if not caller.admin:
            cfg.job.output_dir = str(area / "runs")
        elif cwd and not Path(cfg.job.output_dir).is_absolute():
            cfg.job.output_dir = str(Path(cwd) / cfg.job.output_dir)
        pinned = {}
        for ref in registered_refs(cfg):  # JOB_ID[:STEP] -> pinned to a step the caller may read
            src, step = parse_ref(ref)
            try:
                self.gate.own(src, api_key)
                step, _ = self.registry.checkpoint(src, step)
            except KeyError as e:
                raise ConfigError(f"checkpoint {ref!r}: {e.args[0]}") from None
            pinned[ref] = f"{src}:{step}"
        pin_refs(cfg, pinned)
        problems = missing_resources(bundles_for(cfg), cfg.resources.strategy)
        if problems:
            raise ConfigError("this job can never fit the cluster: " + "; ".join(problems) +
                              ". Lower resources.* / rollout.num_workers or add nodes.")
        job_id = self.registry.create_job(caller.name, cfg.job.name, config_mod.to_dict(cfg))
        self.jobs_.add(job_id)
        return job_id

    async def status(self, job_id: str, api_key: str | None = None) -> JobStatus:
        return self._seen(self.gate.own(job_id, api_key))

    async def jobs(self, api_key: str | None = None) -> list[JobStatus]:
        who = self.gate.caller(api_key)
        return [self._seen(j) for j in self.registry.jobs(None if who.admin else who.name)]

    def _seen(self, job: JobRecord) -> JobStatus:
        """A job's status: a queued one's with why it waits, one healed by restarts with each failure."""
        st = job.status()
        healed = [f"step {r.get(K.STEP)}: {r.get(K.RECOVERY_REASON) or r.get(K.RECOVERY_WORKERS)}"
                  for r in self.registry.recoveries(st.id)]
        st = dataclasses.replace(st, recoveries=healed) if healed else st
        return dataclasses.replace(st, waiting=self.jobs_.waiting(st.id)) if st.state is JobState.QUEUED else st

    async def cancel(self, job_id: str, api_key: str | None = None) -> JobStatus:
        if not self.gate.own(job_id, api_key).state.terminal:
            self.jobs_.cancel(job_id)
        return self.registry.job(job_id).status()

    async def episodes(self, job_id: str, step: int | None = None, api_key: str | None = None) -> EpisodePage:
        """The episodes a job logged at ``step`` (default: its latest), and the steps that have some."""
        self.gate.own(job_id, api_key)
        return EpisodePage(self.registry.episode_steps(job_id), self.registry.episodes(job_id, step))

    async def outputs(self, job_id: str, since: int = 0, limit: int = 1000, api_key: str | None = None) -> list[dict[str, Any]]:
        """An inference job's output rows from index ``since`` on (at most ``limit``)."""
        self.gate.own(job_id, api_key)
        return self.registry.outputs(job_id, since, limit)

    async def checkpoints(self, job_id: str, api_key: str | None = None) -> list[int]:
        self.gate.own(job_id, api_key)
        return self.registry.checkpoints(job_id)

    async def checkpoint(self, job_id: str, step: int | None = None, api_key: str | None = None) -> tuple[int, str]:
        """(step, path) of a job's checkpoint at ``step``, or its latest."""
        self.gate.own(job_id, api_key)
        return self.registry.checkpoint(job_id, step)

    async def checkpoint_blob(self, job_id: str, step: int | None = None,
                              api_key: str | None = None) -> tuple[int, bytes]:
        """(step, packed checkpoint) of a job's checkpoint at ``step``, or its latest."""
        self.gate.own(job_id, api_key)
        step, path = self.registry.checkpoint(job_id, step)
        return step, self.store.get(path)

    async def metrics(self, job_id: str, since: int = 0, api_key: str | None = None) -> list[dict[str, Any]]:
        self.gate.own(job_id, api_key)
        return self.registry.metrics(job_id, since)

    async def metrics_after(self, job_id: str, cursor: int = -1, api_key: str | None = None) -> MetricsPage:
        """A job's metrics rows written after ``cursor``, and the next cursor (``Registry.metrics_after``)."""
        self.gate.own(job_id, api_key)
        return self.registry.metrics_after(job_id, cursor)

    # ------------------------------------------------------------------ a job's driver (job token)

    async def report(self, job_id: str, row: dict[str, Any], token: str | None = None) -> None:
        self.gate.check_job(job_id, token)
        self.registry.set_progress(job_id, row)

    async def report_episodes(self, job_id: str, episodes: list[dict[str, Any]], token: str | None = None) -> None:
        self.gate.check_job(job_id, token)
        self.registry.add_episodes(job_id, episodes)

    async def report_outputs(self, job_id: str, rows: list[dict[str, Any]], token: str | None = None) -> None:
        self.gate.check_job(job_id, token)
        self.registry.add_outputs(job_id, rows)

    async def put_checkpoint(self, job_id: str, step: int, blob: bytes, token: str | None = None) -> str:
        """Store a job's packed checkpoint on this node and register it; returns the stored path."""
        self.gate.check_job(job_id, token)
        path = self.store.put(job_id, step, blob)
        self.registry.add_checkpoint(job_id, step, path)
        return path

    async def ref_blob(self, job_id: str, ref: str, token: str | None = None) -> tuple[int, bytes]:
        """A checkpoint that job ``job_id``'s config names (resume_from, frozen policies), or one of its own
        (a restart resumes from it); the caller's right to read another was checked at submit, so only refs
        in the job's own config are served."""
        self.gate.check_job(job_id, token)
        own = (parse_ref(ref) or ("", None))[0] == job_id
        if not own and ref not in registered_refs(config_mod.load(self.registry.job(job_id).config)):
            raise AuthError(f"job {job_id}'s config does not name checkpoint {ref!r}")
        src, step = parse_ref(ref)
        step, path = self.registry.checkpoint(src, step)
        return step, self.store.get(path)

    # ------------------------------------------------------------------ leases for work run elsewhere

    async def open_lease(self, kind: str, name: str, spec: dict[str, Any], api_key: str | None = None,
                         holder: Any = None, holder_id: str | None = None) -> tuple[str, str]:
        """A RUNNING job record for work another service runs on the key's behalf (a Tinker training
        client: ``kind`` "tinker"), so it shows in ``otray jobs`` and on the dashboard and its owner
        can cancel it. Returns (job id, token): the service reports progress with ``report`` and ends
        it with ``close_lease``; a cancel drops the token, so the service's next report fails.
        ``holder`` (that service's actor, ``holder_id`` its id): the lease fails at once if it dies."""
        caller = self.gate.caller(api_key)
        job_id = self.registry.create_job(caller.name, name, {"job": {"kind": kind, "name": name}, kind: spec})
        self.registry.set_state(job_id, JobState.STARTING)
        self.registry.set_state(job_id, JobState.RUNNING)
        token = self.gate.job_token(job_id)
        if holder is not None and holder_id:
            self.lease_watch.add(holder, holder_id, job_id)
        return job_id, token

    async def check_lease(self, job_id: str, token: str | None = None) -> None:
        """Whether a lease still holds: AuthError once it was cancelled (its token dropped), so the
        service refuses a cancelled client's next request before it runs."""
        self.gate.check_job(job_id, token)

    async def close_lease(self, job_id: str, state: JobState, error: str | None = None,
                          token: str | None = None) -> None:
        """End a lease (SUCCEEDED or FAILED; an already ended one stays as it is)."""
        self.gate.check_job(job_id, token)
        if not self.registry.job(job_id).state.terminal:
            self.registry.set_state(job_id, JobState(state), error)
        self.gate.drop_job(job_id)

    # ------------------------------------------------------------------ the Serve app

    async def auth_required(self) -> bool:
        return self.gate.auth_enabled

    async def whoami(self, api_key: str | None = None) -> Identity:
        """The caller's user name and admin flag (AuthError on a missing or wrong key when auth is on)."""
        who = self.gate.caller(api_key)
        return Identity(who.name, who.admin, self.gate.auth_enabled)

    async def key_tag(self, api_key: str | None = None) -> str | None:
        """The tag of the caller's current key (:meth:`Registry.key_tag`): a token service puts it in the
        tokens it mints for that key (None with auth off)."""
        who = self.gate.caller(api_key)
        return self.registry.key_tag(who.name) if self.gate.auth_enabled else None

    async def key_live(self, name: str, tag: str | None) -> bool:
        """Whether ``tag`` is still ``name``'s key's (False once the key was rotated or the user deleted):
        checked on every request that carries a token minted for it."""
        return not self.gate.auth_enabled or (tag is not None and self.registry.key_tag(name) == tag)

    async def servable(self, api_key: str | None = None) -> list[ServableJob]:
        """The caller's jobs that have checkpoints: id, model path it was trained from, checkpoint steps."""
        who = self.gate.caller(api_key)
        out = []
        for job in self.registry.jobs(None if who.admin else who.name):
            steps = self.registry.checkpoints(job.id)
            if steps:
                out.append(ServableJob(job.id, job.created, job.config["model"]["path"], steps))
        return out

    async def serve_grant(self, job_id: str, step: int | None = None, api_key: str | None = None) -> tuple[int, str, str]:
        """(step, grant, model path) of the caller's checkpoint, for a Serve replica to load it with."""
        job = self.gate.own(job_id, api_key)
        step, _ = self.registry.checkpoint(job_id, step)
        return step, self.gate.grant(job_id, step), job.config["model"]["path"]

    async def serve_checkpoint_blob(self, job_id: str, step: int, grant: str | None = None) -> bytes:
        """A checkpoint for a Serve replica holding its grant (``serve_grant``)."""
        self.gate.check_grant(job_id, step, grant)
        _, path = self.registry.checkpoint(job_id, step)
        return self.store.get(path)

    # ------------------------------------------------------------------ admins

    async def add_user(self, name: str, admin: bool = False, api_key: str | None = None) -> str:
        """A new user's API key (shown once). With auth on, only an admin may add users,
        except the very first user, who becomes an admin."""
        if self.gate.auth_enabled and self.registry.has_users():
            self.gate.admin(api_key, "add users")
        elif self.gate.auth_enabled:
            admin = True
        return self.registry.add_user(name, admin)

    async def users(self, api_key: str | None = None) -> list[UserInfo]:
        self.gate.admin(api_key, "list users")
        return [UserInfo(u.name, u.admin) for u in self.registry.users()]

    async def delete_user(self, name: str, api_key: str | None = None) -> None:
        """Remove a user; their key fails from the next request on (their jobs stay)."""
        self.gate.admin(api_key, "delete users")
        self.registry.delete_user(name)
        self.gate.keys_changed()

    async def rotate_key(self, name: str | None = None, api_key: str | None = None) -> str:
        """A new key for ``name`` (an admin, any user; a user, themselves); the old one stops working."""
        who = self.gate.caller(api_key)
        name = name or who.name
        if name != who.name and not who.admin:
            raise AuthError("only an admin can rotate another user's key")
        key = self.registry.rotate_key(name)
        self.gate.keys_changed()
        return key

    async def allow_modules(self, modules: list[str], api_key: str | None = None) -> list[str]:
        """Let users' configs name code from ``modules`` too (besides the bundled envs)."""
        return self.gate.allow_modules(modules, api_key)

    async def allowed_modules(self) -> list[str]:
        return sorted(self.gate.allowed_modules())

    async def set_job_quota(self, user: str, jobs: int, api_key: str | None = None) -> int:
        """(Admin) how many jobs ``user`` (``*``: everyone without their own) may have queued or running."""
        return self.gate.set_job_quota(user, jobs, api_key)

    async def job_quota(self, user: str | None = None, api_key: str | None = None) -> int:
        """``user``'s job quota (default: the caller's)."""
        return self.gate.job_quota(user or self.gate.caller(api_key).name)

    async def allow_urls(self, urls: list[str], api_key: str | None = None) -> list[str]:
        """Let users' envs reach these addresses too (an OpenReward env server's ``base_url``)."""
        return self.gate.allow_urls(urls, api_key)

    async def allowed_urls(self) -> list[str]:
        return sorted(self.gate.allowed_urls())

    async def placement_group_id(self, job_id: str, api_key: str | None = None) -> str | None:
        self.gate.admin(api_key, "see placement groups")
        pg = self.jobs_.placement_group(job_id)
        return pg.id.hex() if pg is not None else None

    async def driver(self, job_id: str, api_key: str | None = None) -> Any:
        """The job's driver actor handle (tests use it to simulate a crash)."""
        self.gate.admin(api_key, "get a job's driver")
        return self.jobs_.running[job_id][0]


def default_db_path() -> str:
    """``$OTRAY_DB``, else ``<otray home>/registry.db``: one fixed place, whoever creates the manager."""
    return os.environ.get("OTRAY_DB") or str(trust.home() / "registry.db")


def get_or_create(db_path: str | None = None, **kwargs: Any) -> Any:
    """The cluster's ResourceManager: the existing one, or a new detached one that restarts itself
    when its process dies (its registry makes the restart lossless for finished and queued jobs)."""
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        path = str(Path(db_path or default_db_path()).expanduser().absolute())
        return ResourceManager.options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                       max_restarts=-1).remote(path, **kwargs)
