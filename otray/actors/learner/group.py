"""LearnerGroup: one trained policy's sharded learner, behind the PolicyLearner interface.

With ``resources.learner_workers: N > 1`` a job's policy is trained by N
:class:`~otray.actors.learner.rank.LearnerRank` actors (one bundle each, placed by the job's
placement group strategy) that form one torch.distributed process group. The job holds one
handle, a ``LearnerGroup`` actor (no CPU of its own, in the first rank's bundle), with the
methods the job calls on a PolicyLearner: ``forward``, ``forward_backward``, ``optim_step``,
``weights``, ``save_state``, ``load_state``, ``export``, ``info``, ``busy_s``.

How a batch is split (:func:`split_for_ranks`): datums are dealt to ranks in contiguous
shares of about equal tokens; each rank cuts its share into micro-batches of at most
``micro_batch_tokens`` padded tokens, and every rank runs as many micro-batches as the
busiest one (an empty micro-batch is an idle pass), because each forward and backward is a
collective. The aggregation divides by the whole batch's totals on every rank and the ranks'
gradients are summed, so the update is the single learner's on the whole batch. When each
rank's share is exactly one of the single learner's micro-batches the two agree to the last
bit before the optimizer step (tests/actors/learner/test_rank.py); otherwise they differ by float
rounding (other matmul shapes, another summation order).

Failure: every call waits on all ranks at once; the first rank that fails (its actor died,
or it raised, e.g. a collective timed out after ``resources.collective_timeout_s``) fails
the call with :class:`LearnerGroupError` naming the rank and its node, and the other ranks
are killed so that none stays blocked in a collective. The job then fails like any job
whose learner died: FAILED, its placement group freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from otray.actors.learner.core import PAD_SPREAD, LossSums, by_length, global_normalizer, in_order, micro_batches
from otray.records import CheckpointMeta
from otray.types import ConfigError, Datum, LearnerInfo, LossNormalizer, ModelLoadError, WeightUpdate


class LearnerGroupError(RuntimeError):
    """A rank of a sharded learner failed; the group is unusable after it."""


def split_for_ranks(datums: Sequence[Datum], ranks: int) -> list[list[int]]:
    """Indices of ``datums`` per rank: contiguous shares whose token counts are as even as the cut
    allows (rank r takes the datums whose token midpoint falls in its r-th of the total)."""
    total = sum(len(d) for d in datums)
    shares: list[list[int]] = [[] for _ in range(ranks)]
    seen = 0
    for i, d in enumerate(datums):
        middle = seen + len(d) / 2
        shares[min(int(middle * ranks / max(total, 1)), ranks - 1)].append(i)
        seen += len(d)
    return shares


def rank_batches(datums: Sequence[Datum], ranks: int, token_budget: int) -> tuple[list[list[list[Datum]]], list[int]]:
    """Each rank's micro-batches (datums shortest first, as a single learner orders them), padded with
    empty ones to the same count, and the datum order they come back in (rank 0's micro-batches
    first): ``order[k]`` is the k-th returned datum's index in ``datums``."""
    order = by_length(datums)
    shares = [[order[k] for k in share] for share in split_for_ranks([datums[i] for i in order], ranks)]
    per_rank = [micro_batches([datums[i] for i in share], token_budget, PAD_SPREAD) if share else []
                for share in shares]
    most = max(len(b) for b in per_rank)
    padded = [b + [[] for _ in range(most - len(b))] for b in per_rank]
    return padded, [i for share in shares for i in share]


class LearnerGroup:
    """N LearnerRank actors driven as one PolicyLearner (see the module docstring)."""

    def __init__(self, ranks: list[Any], micro_batch_tokens: int, timeout_s: float):
        self.ranks = list(ranks)
        self.micro_batch_tokens = micro_batch_tokens
        self.failed: str | None = None
        self.nodes = [i.node_id for i in self._all([r.info.remote() for r in self.ranks])]
        address = self._all([self.ranks[0].address.remote()])[0]
        self._all([r.join.remote(address, timeout_s) for r in self.ranks])
        if self.micro_batch_tokens <= 0:  # auto: what the tightest rank can hold (precision.budget_for)
            self.micro_batch_tokens = min(self._all([r.token_budget.remote() for r in self.ranks]))

    # ------------------------------------------------------------------ waiting on every rank

    def _all(self, refs: list[Any]) -> list[Any]:
        """Every rank's result, in rank order; the first failure kills the group (module docstring)."""
        if self.failed:
            raise LearnerGroupError(f"the sharded learner failed earlier: {self.failed}")
        index = {ref: r for r, ref in enumerate(refs)}
        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            r = index[done[0]]
            try:
                results[r] = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - named, then re-raised as the group's error
                node = self.nodes[r] if getattr(self, "nodes", None) else "?"
                self.failed = f"learner rank {r} of {len(self.ranks)} (node {node}) failed: {type(exc).__name__}: {exc}"
                for other in self.ranks:  # none may wait in a collective for the failed one
                    ray.kill(other, no_restart=True)
                cause = getattr(exc, "cause", None)
                if isinstance(cause, (ConfigError, ModelLoadError)):
                    raise cause  # the user's input, as a single learner would have said it
                raise LearnerGroupError(self.failed) from exc
        return [results[r] for r in range(len(refs))]

    # ------------------------------------------------------------------ the PolicyLearner interface

    def ping(self) -> bool:
        return True

    def info(self) -> LearnerInfo:
        return self._all([self.ranks[0].info.remote()])[0]

    def policy_version(self) -> int:
        return self.info().policy_version

    def rank_nodes(self) -> list[str | None]:
        """The Ray node of each rank, in rank order."""
        return list(self.nodes)

    def busy_s(self) -> float:
        """The busiest rank's seconds (ranks run side by side)."""
        return max(self._all([r.busy_s.remote() for r in self.ranks]))

    def forward(self, datums: Sequence[Datum]) -> list[list[float]]:
        if not datums:
            return []
        batches, order = rank_batches(datums, len(self.ranks), self.micro_batch_tokens)
        per_rank = self._all([r.logprobs_of.remote(b) for r, b in zip(self.ranks, batches)])
        return in_order([row for rank_rows in per_rank for batch_rows in rank_rows for row in batch_rows], order)

    def forward_backward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None,
                         aggregation: str = "token_mean", normalizer: LossNormalizer | None = None,
                         kl_to_start: float = 0.0) -> dict[str, float]:
        """PolicyLearner.forward_backward over the ranks: the whole batch's normalizer on each. (No
        ``kl_to_start``: the ranks hold no starting policy; the config refuses algo.kl_coeff here.)"""
        if kl_to_start:
            raise ValueError("a sharded learner holds no starting policy: kl_to_start must be 0")
        if not datums:
            return LossSums().metrics(loss_fn)
        norm = global_normalizer(datums, normalizer)
        batches, _ = rank_batches(datums, len(self.ranks), self.micro_batch_tokens)
        sums = self._all([r.accumulate.remote(b, loss_fn, loss_fn_config, aggregation, norm)
                          for r, b in zip(self.ranks, batches)])
        total = sums[0]
        for s in sums[1:]:
            total = total.plus(s)
        return total.metrics(loss_fn)

    def set_anchor(self, keep: bool = False) -> bool:
        raise ValueError("a sharded learner holds no starting policy (algo.kl_coeff must be 0)")

    def optim_step(self, learning_rate: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0, grad_clip: float | None = 1.0,
                   vision_lr_scale: float | None = None) -> dict[str, float]:
        """Each rank steps its shard; the gradient norm is the whole model's (clipping is global)."""
        return self._all([r.optim_step.remote(learning_rate, betas, eps, weight_decay, grad_clip, vision_lr_scale)
                          for r in self.ranks])[0]

    def weights(self, transport: str = "object_store", dtype: str | None = None) -> WeightUpdate:
        return self._all([r.weights.remote(transport, dtype) for r in self.ranks])[0]

    def export(self, path: str) -> str:
        return self._all([r.export.remote(path) for r in self.ranks])[0]

    def save_state(self, path: str, extra_state: dict[str, Any] | None = None) -> str:
        """Every rank's shard, gathered on rank 0's node (whose job driver keeps the checkpoint)."""
        files = self._all([r.save_state.remote(path, extra_state) for r in self.ranks])
        others = {name: data for rank_files in files[1:] for name, data in rank_files.items()}
        if others:
            self._all([self.ranks[0].add_files.remote(path, others)])
        return path

    def load_state(self, path: str) -> CheckpointMeta:
        """Every rank loads ``path`` (on rank 0's node); ranks on other nodes get a packed copy."""
        blob = None
        if any(node != self.nodes[0] for node in self.nodes):
            blob = self._all([self.ranks[0].packed.remote(path)])[0]
        return self._all([r.load_state.remote(path, None if node == self.nodes[0] else blob)
                          for r, node in zip(self.ranks, self.nodes)])[0]
