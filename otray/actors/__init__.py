"""Ray actors: ResourceManager, TrainJob driver, PolicyLearner, RolloutWorker."""

from __future__ import annotations


def current_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): how tests see where actors landed."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a diagnostic, never fatal
        return None
