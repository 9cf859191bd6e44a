"""Where an actor runs: its bundle of a job's placement group, its OpenMP threads, its node.

Small helpers every role folder needs when it creates or describes an actor (jobs, the Tinker
service, the learners and samplers), kept below them all so none imports another's folder for them.
"""

from __future__ import annotations

import os
from typing import Any


def in_bundle(placement_group: Any, index: int) -> dict[str, Any]:
    """Actor options that pin an actor to one bundle of the job's placement group (or nothing)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=index)}


def threads_env(num_threads: int | None, num_cpus: float | None = None) -> dict[str, Any]:
    """Actor options that give an actor's OpenMP ``num_threads`` threads from process start.

    Ray sets ``OMP_NUM_THREADS`` to the actor's ``num_cpus``; ``torch.set_num_threads``
    raises torch's own count later, but measured here (2 cores, learner with
    ``num_cpus=1`` and 2 threads) forward_backward still ran ~8% slower than with the
    variable set to 2 up front. Ray merges these ``env_vars`` into the job's runtime env.

    Nothing when Ray's own default already gives ``num_threads`` (``num_cpus`` rounds down to
    it and this process's environment, which Ray's workers share, names no other count): an
    actor with a ``runtime_env`` starts through Ray's ``setup_worker.py``, an extra interpreter
    (measured: ~0.4 s of a core per actor start).
    """
    if not num_threads:
        return {}
    n = str(num_threads)
    if num_cpus is not None and max(1, int(num_cpus)) == num_threads \
            and os.environ.get("OMP_NUM_THREADS", n) == n and os.environ.get("MKL_NUM_THREADS", n) == n:
        return {}
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}}}


def cluster_env(address: str, env_vars: dict[str, str]) -> dict[str, Any]:
    """``ray.init`` options that give every worker of this driver's cluster ``env_vars``.

    A cluster this process starts (``address="local"``) inherits its environment, so the
    variables go there (names already set keep their value) and no ``runtime_env`` is needed:
    with one every worker would start through ``setup_worker.py`` (see :func:`threads_env`).
    A cluster joined at another address gets them as the job's ``runtime_env``.
    """
    for k, v in env_vars.items():
        os.environ.setdefault(k, v)
    if address == "local":
        return {}
    return {"runtime_env": {"env_vars": {k: os.environ[k] for k in env_vars}}}


def current_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): how tests see where actors landed."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a diagnostic, never fatal
        return None
