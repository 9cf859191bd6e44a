"""ResourceManager: the named, detached actor that owns jobs and their leases.

One placement group per job, sized from the job's ``resources`` section (bundle 0:
learner + job driver; bundle 1+i: rollout worker i). Jobs wait in a FIFO queue
until their placement group can be placed; a job that can never fit the cluster is
rejected at submit with the missing resource named. The lease (placement group) is
released on every exit path: success, failure, cancel, job actor death.

The registry (SQLite) is the source of truth: a restarted ResourceManager reads
it back; jobs that were queued are queued again, jobs that were starting or
running when the manager died are marked FAILED (their actors died with it).

Start or find it with :func:`get_or_create`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from pathlib import Path
from typing import Any

import ray

from otray import config as config_mod
from otray.actors.checkpoint_store import (CheckpointStore, fetched_dir, pack_dir, parse_ref, pin_refs,
                                          registered_refs, unpack_dir)
from otray.actors.registry import AuthError, JobRecord, JobState, Registry
from otray.types import ConfigError

log = logging.getLogger(__name__)
NAMESPACE, NAME = "otray", "resource_manager"
POLL_S = 0.2


def bundles_for(cfg: config_mod.Config) -> list[dict[str, float]]:
    """Bundle 0: learner (+ the job driver, 0 CPU); bundle 1+i: rollout worker i. GPUs only where asked."""
    res = cfg.resources

    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    policy = [bundle(res.learner_cpus, res.learner_gpus)] + [
        bundle(res.rollout_cpus, res.rollout_gpus) for _ in range(config_mod.num_rollout_workers(cfg))]
    # a game's further trained policies: the same block each; a frozen policy: one rollout bundle each
    return (policy * len(config_mod.trained_policies(cfg))
            + [bundle(res.rollout_cpus, res.rollout_gpus) for _ in config_mod.frozen_policies(cfg)])


def missing_resources(bundles: list[dict[str, float]], strategy: str) -> list[str]:
    """Why ``bundles`` can never fit this cluster (empty when they can)."""
    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    problems = [f"{k}: needs {v:g}, the cluster has {total.get(k, 0):g}" for k, v in need.items() if v > total.get(k, 0)]
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if strategy == "STRICT_PACK":
        for k, v in need.items():
            biggest = max((n.get(k, 0) for n in nodes), default=0)
            if v > biggest:
                problems.append(f"{k}: STRICT_PACK needs {v:g} on one node, the largest node has {biggest:g}")
    elif strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        problems.append(f"nodes: STRICT_SPREAD needs {len(bundles)} nodes (one per bundle), the cluster has {len(nodes)}")
    for b in bundles:  # any strategy: each bundle must fit on some node
        if not any(all(n.get(k, 0) >= v for k, v in b.items()) for n in nodes):
            problems.append(f"bundle {b}: no node has that much")
            break
    return problems


@ray.remote(num_cpus=0)
class JobDriver:
    """Runs one job inside its placement group and reports rows to the ResourceManager."""

    def __init__(self, cfg_dict: dict[str, Any], job_dir: str, job_id: str):
        self.cfg, self.job_dir, self.job_id = config_mod.load(cfg_dict), Path(job_dir), job_id

    def ping(self) -> bool:
        return True

    def run(self) -> dict[str, Any]:
        from ray.util import get_current_placement_group

        from otray.actors.run import run

        rm = ray.get_actor(NAME, namespace=NAMESPACE)
        for ref in registered_refs(self.cfg):  # registered checkpoints (pinned at submit): fetch them through Ray
            step, blob = ray.get(rm.ref_blob.remote(self.job_id, ref))
            local = unpack_dir(blob, fetched_dir(self.job_dir, ref))
            if ref == self.cfg.checkpoint.resume_from:
                self.cfg.checkpoint.resume_from = str(local)
        return run(self.cfg, self.job_dir, placement_group=get_current_placement_group(),
                   report=lambda row: rm.report.remote(self.job_id, row),
                   on_episodes=lambda episodes: rm.report_episodes.remote(self.job_id, episodes),
                   on_outputs=lambda rows: ray.get(rm.report_outputs.remote(self.job_id, rows)),
                   on_checkpoint=lambda step, path: ray.get(rm.put_checkpoint.remote(self.job_id, step, pack_dir(path))))


@ray.remote(num_cpus=0, max_concurrency=64)
class ResourceManager:
    def __init__(self, db_path: str, *, auth_enabled: bool = False, output_dir: str = "runs",
                 store_dir: str | None = None):
        self.registry = Registry(db_path)
        self.store = CheckpointStore(store_dir or Path(db_path).parent / "checkpoints")
        self.auth_enabled, self.output_dir = auth_enabled, output_dir
        self.queue: deque[str] = deque()
        self.pending: dict[str, Any] = {}  # job id -> placement group not yet placed
        self.running: dict[str, tuple[Any, Any]] = {}  # job id -> (driver actor, placement group)
        for job in self.registry.jobs():
            if job.state is JobState.QUEUED:
                self.queue.append(job.id)
            elif job.state in (JobState.STARTING, JobState.RUNNING):
                self.registry.set_state(job.id, JobState.FAILED, "the resource manager restarted while the job ran")
        self._scheduler: asyncio.Task | None = None

    async def ping(self) -> bool:
        return True

    # ------------------------------------------------------------------ auth

    def _caller(self, api_key: str | None) -> tuple[str, bool]:
        if not self.auth_enabled:
            return "local", True
        user = self.registry.authenticate(api_key)
        return user.name, user.admin

    def _own(self, job_id: str, api_key: str | None) -> JobRecord:
        name, admin = self._caller(api_key)
        job = self.registry.job(job_id)
        if not admin and job.owner != name:
            raise AuthError(f"job {job_id} belongs to another user; you can see and cancel only your own jobs")
        return job

    # ------------------------------------------------------------------ API

    async def submit(self, cfg_dict: dict[str, Any], api_key: str | None = None) -> str:
        owner, _ = self._caller(api_key)
        cfg = config_mod.load(cfg_dict)
        pinned = {}
        for ref in registered_refs(cfg):  # JOB_ID[:STEP] -> pinned to a step the caller may read
            src, step = parse_ref(ref)
            try:
                self._own(src, api_key)
                step, _ = self.registry.checkpoint(src, step)
            except KeyError as e:
                raise ConfigError(f"checkpoint {ref!r}: {e.args[0]}") from None
            pinned[ref] = f"{src}:{step}"
        pin_refs(cfg, pinned)
        problems = missing_resources(bundles_for(cfg), cfg.resources.strategy)
        if problems:
            raise ConfigError("this job can never fit the cluster: " + "; ".join(problems) +
                              ". Lower resources.* / rollout.num_workers or add nodes.")
        job_id = self.registry.create_job(owner, cfg.job.name, config_mod.to_dict(cfg))
        self.queue.append(job_id)
        self._kick()
        return job_id

    async def status(self, job_id: str, api_key: str | None = None) -> dict[str, Any]:
        return _public(self._own(job_id, api_key))

    async def jobs(self, api_key: str | None = None) -> list[dict[str, Any]]:
        name, admin = self._caller(api_key)
        return [_public(j) for j in self.registry.jobs(None if admin else name)]

    async def cancel(self, job_id: str, api_key: str | None = None) -> dict[str, Any]:
        job = self._own(job_id, api_key)
        if job.state.terminal:
            return _public(job)
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
        self._kick()
        return _public(self.registry.job(job_id))

    async def report(self, job_id: str, row: dict[str, Any]) -> None:
        self.registry.set_progress(job_id, row)

    async def report_episodes(self, job_id: str, episodes: list[dict[str, Any]]) -> None:
        self.registry.add_episodes(job_id, episodes)

    async def episodes(self, job_id: str, step: int | None = None, api_key: str | None = None) -> dict[str, Any]:
        """The episodes a job logged at ``step`` (default: its latest), and the steps that have some."""
        self._own(job_id, api_key)
        return {"steps": self.registry.episode_steps(job_id), "episodes": self.registry.episodes(job_id, step)}

    async def report_outputs(self, job_id: str, rows: list[dict[str, Any]]) -> None:
        self.registry.add_outputs(job_id, rows)

    async def outputs(self, job_id: str, since: int = 0, limit: int = 1000, api_key: str | None = None) -> list[dict[str, Any]]:
        """An inference job's output rows from index ``since`` on (at most ``limit``)."""
        self._own(job_id, api_key)
        return self.registry.outputs(job_id, since, limit)

    async def checkpoints(self, job_id: str, api_key: str | None = None) -> list[int]:
        self._own(job_id, api_key)
        return self.registry.checkpoints(job_id)

    async def put_checkpoint(self, job_id: str, step: int, blob: bytes) -> str:
        """Store a job's packed checkpoint on this node and register it; returns the stored path."""
        path = self.store.put(job_id, step, blob)
        self.registry.add_checkpoint(job_id, step, path)
        return path

    async def checkpoint_blob(self, job_id: str, step: int | None = None,
                              api_key: str | None = None) -> tuple[int, bytes]:
        """(step, packed checkpoint) of a job's checkpoint at ``step``, or its latest."""
        self._own(job_id, api_key)
        step, path = self.registry.checkpoint(job_id, step)
        return step, self.store.get(path)

    async def ref_blob(self, job_id: str, ref: str) -> tuple[int, bytes]:
        """A checkpoint that job ``job_id``'s config names (resume_from, frozen policies); the caller's
        right to read it was checked at submit, so only refs in the job's own config are served."""
        if ref not in registered_refs(config_mod.load(self.registry.job(job_id).config)):
            raise AuthError(f"job {job_id}'s config does not name checkpoint {ref!r}")
        src, step = parse_ref(ref)
        step, path = self.registry.checkpoint(src, step)
        return step, self.store.get(path)

    # ------------------------------------------------------------------ for the Serve app

    async def auth_required(self) -> bool:
        return self.auth_enabled

    async def whoami(self, api_key: str | None = None) -> dict[str, Any]:
        """The caller's user name and admin flag (AuthError on a missing or wrong key when auth is on)."""
        name, admin = self._caller(api_key)
        return {"name": name, "admin": admin, "auth_enabled": self.auth_enabled}

    async def servable(self, api_key: str | None = None) -> list[dict[str, Any]]:
        """The caller's jobs that have checkpoints: id, model path it was trained from, checkpoint steps."""
        name, admin = self._caller(api_key)
        out = []
        for job in self.registry.jobs(None if admin else name):
            steps = self.registry.checkpoints(job.id)
            if steps:
                out.append({"id": job.id, "created": job.created, "model_path": job.config["model"]["path"],
                            "steps": steps})
        return out

    async def serve_checkpoint_blob(self, job_id: str, step: int) -> bytes:
        """A checkpoint for a Serve replica; the app checked the HTTP caller's right to it (``checkpoint``)."""
        _, path = self.registry.checkpoint(job_id, step)
        return self.store.get(path)

    async def checkpoint(self, job_id: str, step: int | None = None, api_key: str | None = None) -> tuple[int, str]:
        """(step, path) of a job's checkpoint at ``step``, or its latest."""
        self._own(job_id, api_key)
        return self.registry.checkpoint(job_id, step)

    async def metrics(self, job_id: str, since: int = 0, api_key: str | None = None) -> list[dict[str, Any]]:
        self._own(job_id, api_key)
        return self.registry.metrics(job_id, since)

    async def add_user(self, name: str, admin: bool = False, api_key: str | None = None) -> str:
        """A new user's API key (shown once). With auth on, only an admin may add users,
        except the very first user, who becomes an admin."""
        if self.auth_enabled and self.registry.has_users():
            _, is_admin = self._caller(api_key)
            if not is_admin:
                raise AuthError("only an admin can add users")
        elif self.auth_enabled:
            admin = True
        return self.registry.add_user(name, admin)

    async def placement_group_id(self, job_id: str) -> str | None:
        pair = self.running.get(job_id)
        pg = pair[1] if pair else self.pending.get(job_id)
        return pg.id.hex() if pg is not None else None

    async def driver(self, job_id: str) -> Any:
        """The job's driver actor handle (tests use it to simulate a crash)."""
        return self.running[job_id][0]

    # ------------------------------------------------------------------ scheduling

    def _kick(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def _schedule(self) -> None:
        """Place queued jobs in FIFO order; the head waits until its placement group fits."""
        from ray.util.placement_group import placement_group

        while self.queue:
            job_id = self.queue[0]
            cfg = config_mod.load(self.registry.job(job_id).config)
            pg = self.pending.get(job_id) or placement_group(bundles_for(cfg), strategy=cfg.resources.strategy)
            self.pending[job_id] = pg
            while not ray.wait([pg.ready()], timeout=0)[0]:
                await asyncio.sleep(POLL_S)
                if job_id not in self.pending:  # cancelled while waiting
                    break
            if self.pending.pop(job_id, None) is None or not self.queue or self.queue[0] != job_id:
                continue
            self.queue.popleft()
            await self._start(job_id, cfg, pg)

    async def _start(self, job_id: str, cfg: config_mod.Config, pg: Any) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.registry.set_state(job_id, JobState.STARTING)
        job_dir = str(Path(cfg.job.output_dir if cfg.job.output_dir != "runs" else self.output_dir).absolute() / job_id)
        driver = JobDriver.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote(config_mod.to_dict(cfg), job_dir, job_id)
        self.running[job_id] = (driver, pg)
        try:
            await driver.ping.remote()
        except Exception as e:  # noqa: BLE001
            return self._finish(job_id, JobState.FAILED, f"job driver failed to start: {e}")
        self.registry.set_state(job_id, JobState.RUNNING)
        asyncio.get_running_loop().create_task(self._watch(job_id, driver.run.remote()))

    async def _watch(self, job_id: str, ref: Any) -> None:
        try:
            await ref
        except Exception as e:  # noqa: BLE001 - any failure ends the job as FAILED
            if self.registry.job(job_id).state is not JobState.CANCELLED:
                self._finish(job_id, JobState.FAILED, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:1000]}")
            return
        self._finish(job_id, JobState.SUCCEEDED, None)

    def _finish(self, job_id: str, state: JobState, error: str | None) -> None:
        pair = self.running.pop(job_id, None)
        if pair is not None:
            ray.util.remove_placement_group(pair[1])
        if not self.registry.job(job_id).state.terminal:
            self.registry.set_state(job_id, state, error)
        self._kick()


def _public(job: JobRecord) -> dict[str, Any]:
    kind = job.config.get("job", {}).get("kind", "rl")
    total = 1 if kind == "infer" else job.config.get("sft" if kind == "sft" else "algo", {}).get("steps")
    return {"id": job.id, "owner": job.owner, "name": job.name, "state": job.state.value, "error": job.error,
            "progress": job.progress, "created": job.created, "started": job.started, "finished": job.finished,
            "kind": kind, "total_steps": total}


def get_or_create(db_path: str = ".otray/registry.db", **kwargs: Any) -> Any:
    """The cluster's ResourceManager: the existing one, or a new detached one."""
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return ResourceManager.options(name=NAME, namespace=NAMESPACE, lifetime="detached",
                                       get_if_exists=True).remote(str(Path(db_path).absolute()), **kwargs)
