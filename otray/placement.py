"""Where an actor runs: its bundle of a job's placement group, its OpenMP threads, its node.

Small helpers every role folder needs when it creates or describes an actor (jobs, the Tinker
service, the learners and samplers), kept below them all so none imports another's folder for them.
"""

from __future__ import annotations

from typing import Any


def in_bundle(placement_group: Any, index: int) -> dict[str, Any]:
    """Actor options that pin an actor to one bundle of the job's placement group (or nothing)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=index)}


def threads_env(num_threads: int | None) -> dict[str, Any]:
    """Actor options that give an actor's OpenMP ``num_threads`` threads from process start.

    Ray sets ``OMP_NUM_THREADS`` to the actor's ``num_cpus``; ``torch.set_num_threads``
    raises torch's own count later, but measured here (2 cores, learner with
    ``num_cpus=1`` and 2 threads) forward_backward still ran ~8% slower than with the
    variable set to 2 up front. Ray merges these ``env_vars`` into the job's runtime env.
    """
    if not num_threads:
        return {}
    n = str(num_threads)
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}}}


def current_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): how tests see where actors landed."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a diagnostic, never fatal
        return None
