"""A job's lease: the bundles it needs, whether they can ever fit, and the driver that runs in them.

One placement group per job, sized from the job's ``resources`` section (bundle 0:
learner + job driver; then the other learner ranks, if sharded; then the rollout workers). The :class:`JobDriver` runs in
bundle 0 and reports to the ResourceManager with the job token it was given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from otray import config as config_mod
from otray.checkpoints import fetched_dir, pack_dir, registered_refs, unpack_dir

NAMESPACE, NAME = "otray", "resource_manager"


def bundles_for(cfg: config_mod.Config) -> list[dict[str, float]]:
    """Per trained policy: one bundle per learner rank (the first also holds the job driver, 0 CPU), then
    one per rollout worker; then one per frozen game policy, then one per league worker. GPUs only where asked."""
    res = cfg.resources

    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    policy = [bundle(res.learner_cpus, res.learner_gpus)] * config_mod.learner_ranks(cfg) + [
        bundle(res.rollout_cpus, res.rollout_gpus) for _ in range(config_mod.num_rollout_workers(cfg))]
    # a game's further trained policies: the same block each; a frozen policy: one rollout bundle each;
    # league play: one rollout bundle per trained policy (the worker that plays its drawn snapshot)
    return (policy * len(config_mod.trained_policies(cfg))
            + [bundle(res.rollout_cpus, res.rollout_gpus) for _ in config_mod.frozen_policies(cfg)]
            + [bundle(res.rollout_cpus, res.rollout_gpus) for _ in range(config_mod.league_workers(cfg))])


def _summed(bundles: list[dict[str, float]]) -> dict[str, float]:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return need


def missing_resources(bundles: list[dict[str, float]], strategy: str) -> list[str]:
    """Why ``bundles`` can never fit this cluster (empty when they can)."""
    total = ray.cluster_resources()
    need = _summed(bundles)
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


def placement_wait(pg: Any) -> str:
    """Why ``pg`` is not placed yet, in words for a user: what the job needs (its bundles, as asked)
    against what the cluster has free now (other jobs and actors hold the rest), and Ray's own state
    of the placement group when the resources look free (then Ray, not otray, is the one to ask)."""
    from ray.util import placement_group_table

    bundles = pg.bundle_specs
    need, free, total = _summed(bundles), ray.available_resources(), ray.cluster_resources()
    short = [f"{k} {v:g} (free now {free.get(k, 0.0):g} of {total.get(k, 0.0):g})" for k, v in need.items()
             if v > free.get(k, 0.0) + 1e-9]
    if short:
        others = sorted(t.get("name") or pg_id for pg_id, t in placement_group_table().items()
                        if t.get("state") == "CREATED" and pg_id != pg.id.hex())
        return ("waiting for resources that other jobs or actors hold; it needs " + ", ".join(short) + "; "
                + (f"placement groups holding some now: {', '.join(others)}" if others else
                   "no other placement group holds any (actors outside jobs, or a cluster still starting)"))
    state = placement_group_table(pg).get("state", "unknown")
    asked = ", ".join(f"{k} {v:g}" for k, v in need.items())
    return (f"its placement group ({len(bundles)} bundles: {asked}) is {state} in Ray although that much is free "
            f"now: `ray status` and the raylet logs say why")


async def placed(pg: Any, wanted: Callable[[], bool], poll_s: float) -> bool:
    """Wait, without blocking the event loop, until Ray has placed ``pg``: True then; False as soon as
    ``wanted()`` (asked once a poll, every ``poll_s`` seconds) says the job no longer wants it.

    One ``pg.ready()`` reference is made and polled. Each ``pg.ready()`` is a new object that a reply from
    Ray's GCS fills in later, so a fresh one checked with a zero timeout loses that race most of the time
    (64 of 200 fresh references to a group placed long before were ready): asking afresh each poll could
    leave a job that fits QUEUED for as long as the race kept being lost."""
    ready = pg.ready()
    while not ray.wait([ready], timeout=0)[0]:
        await asyncio.sleep(poll_s)
        if not wanted():
            return False
    return True


@ray.remote(num_cpus=0)
class JobDriver:
    """Runs one job inside its placement group and reports rows to the ResourceManager."""

    def __init__(self, cfg_dict: dict[str, Any], job_dir: str, job_id: str, token: str):
        self.cfg, self.job_dir, self.job_id = config_mod.load(cfg_dict), Path(job_dir), job_id
        self.token = token  # what the ResourceManager checks on every call this job makes

    def ping(self) -> bool:
        return True

    def run(self) -> dict[str, Any]:
        from ray.util import get_current_placement_group

        from otray.actors.job.run import run

        rm = ray.get_actor(NAME, namespace=NAMESPACE)
        for ref in registered_refs(self.cfg):  # registered checkpoints (pinned at submit): fetch them through Ray
            step, blob = ray.get(rm.ref_blob.remote(self.job_id, ref, self.token))
            local = unpack_dir(blob, fetched_dir(self.job_dir, ref))
            if ref == self.cfg.checkpoint.resume_from:
                self.cfg.checkpoint.resume_from = str(local)
        sent: list[ray.ObjectRef] = []  # rows and episodes go without waiting for the manager ...

        def send(ref: ray.ObjectRef) -> None:
            sent.append(ref)
            if len(sent) > 64:
                sent[:] = ray.wait(sent, num_returns=len(sent), timeout=0)[1]

        try:
            return run(self.cfg, self.job_dir, placement_group=get_current_placement_group(),
                       report=lambda row: send(rm.report.remote(self.job_id, row, self.token)),
                       on_episodes=lambda episodes: send(rm.report_episodes.remote(self.job_id, episodes, self.token)),
                       on_outputs=lambda rows: ray.get(rm.report_outputs.remote(self.job_id, rows, self.token)),
                       on_checkpoint=lambda step, path: ray.get(
                           rm.put_checkpoint.remote(self.job_id, step, pack_dir(path), self.token)))
        finally:  # ... but have reached it before run() returns: the manager then ends the job with its last row
            # (CI, session 55: a job SUCCEEDED with its status at step 1 of 2, the last report still in flight)
            ray.wait(sent, num_returns=len(sent), timeout=30)
