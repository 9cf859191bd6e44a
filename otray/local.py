"""Local-only training primitives: a PolicyLearner and a RolloutWorker as plain Ray actors, for a
custom loop on your own machine.

    from otray.local import TrainingClient
    tc = TrainingClient.for_model("tiny", lora_rank=8)
    tc.forward_backward(datums, "importance_sampling")
    tc.optim_step(1e-4)
    sc = tc.sampling_client()
    sc.sample(prompt_ids, SamplingParams(max_tokens=16), n=4)

These actors are not leased through the ResourceManager and check no key: they are for a script
on a cluster you own. Their losses are otray's (``otray.algos.losses``: ``forward_backward``
aggregates with ``token_mean`` by default). On a shared cluster, or for Tinker's semantics (losses
as sums, many users' LoRA adapters on one base), run ``otray tinker`` and point the ``tinker`` SDK
at it. Both paths use the same learner core (``otray.actors.learner.core``).
"""

from __future__ import annotations

from typing import Any

from otray.records import CheckpointMeta
from otray.types import LossNormalizer


class TrainingClient:
    """Tinker-style primitives on a PolicyLearner actor, for custom training loops.

    Each call blocks and returns the learner's result; ``self.learner`` is the actor
    handle for callers who want futures (``tc.learner.forward_backward.remote(...)``).
    """

    @classmethod
    def for_model(cls, model: str = "tiny", *, lora_rank: int = 0, **kwargs: Any) -> TrainingClient:
        """A learner for ``model``: a local directory, a hub id or ``tiny`` (built on first use)."""
        from otray.models import resolve_model_path

        return cls(resolve_model_path(model), lora_rank=lora_rank, **kwargs)

    def __init__(self, model_path: str, *, lora_rank: int = 0, num_cpus: float = 1, **learner_kwargs: Any):
        import ray

        from otray.actors.learner.policy_learner import PolicyLearner

        self.model_path = model_path
        lora = {"rank": lora_rank, **learner_kwargs.pop("lora", {})}
        self.learner = ray.remote(num_cpus=num_cpus)(PolicyLearner).remote(model_path, lora=lora, **learner_kwargs)

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref)

    def forward(self, datums: list) -> list[list[float]]:
        return self._get(self.learner.forward.remote(datums))

    def forward_backward(self, datums: list, loss_fn: str, loss_fn_config: dict[str, float] | None = None,
                         aggregation: str = "token_mean", normalizer: LossNormalizer | None = None) -> dict[str, float]:
        return self._get(self.learner.forward_backward.remote(datums, loss_fn, loss_fn_config, aggregation, normalizer))

    def optim_step(self, learning_rate: float = 1e-4, **adam: Any) -> dict[str, float]:
        return self._get(self.learner.optim_step.remote(learning_rate, **adam))

    def save_state(self, path: str) -> str:
        return self._get(self.learner.save_state.remote(path))

    def load_state(self, path: str) -> CheckpointMeta:
        return self._get(self.learner.load_state.remote(path))

    def sampling_client(self, backend: str = "hf", **worker_kwargs: Any) -> SamplingClient:
        """A rollout worker holding this learner's *current* weights (sent via the object store)."""
        client = SamplingClient(self.model_path, backend, **worker_kwargs)
        client.update(self.learner.weights.remote())
        return client


class SamplingClient:
    """Sampling on a RolloutWorker actor: ``sample(prompt_ids, params, n)``."""

    def __init__(self, model_path: str, backend: str = "hf", *, num_cpus: float = 1, **worker_kwargs: Any):
        import ray

        from otray.actors.sampling.rollout import RolloutWorker

        self.worker = ray.remote(num_cpus=num_cpus)(RolloutWorker).remote(model_path, backend, **worker_kwargs)

    def update(self, weights_ref: Any) -> int:
        import ray

        return ray.get(self.worker.update_weights.remote(weights_ref))

    def sample(self, prompt_ids: list[list[int]], params: Any, n: int = 1) -> list:
        import ray

        return ray.get(self.worker.generate.remote(prompt_ids, params, n))
