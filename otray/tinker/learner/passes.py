"""What one shared pass is asked and what it answers: :class:`PassRequest` (one client's slice of
forward(_backward) work), :class:`PassResult`, :class:`TrainStepResult` and :class:`PassNotRun` (a pass that
failed before adding any gradient). Plain data without torch: the queue that packs requests and the processes
that create the learner import them; :mod:`otray.tinker.learner.shared_pass` runs them.

Runs in the SharedLearner actor of one base model (and is imported where it is created)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from otray.tinker.learner.loss_graph import LossGraph
from otray.types import Datum


@dataclass
class PassResult:
    """One forward(_backward) call: per datum, each target token's logprob and loss; the loss sum."""

    logprobs: list[list[float]]
    losses: list[list[float]]
    loss_sum: float
    metric_sums: dict[str, float] = field(default_factory=dict)  # a custom loss's metrics, summed over datums


@dataclass
class TrainStepResult:
    """A forward_backward and the optim_step after it, sent as one learner call (``SharedLearner.train_step``):
    each part's result, or the exception it raised (the parts fail alone, as two calls would)."""

    forward_backward: PassResult | BaseException
    optim_step: dict[str, float] | BaseException


class PassNotRun(Exception):
    """A shared pass failed before it added any gradient (its cause chained): its requests can be run
    again one by one."""


@dataclass(frozen=True)
class PassRequest:
    """One client's forward(_backward) work for a pass: its adapter, datums and loss (``graph``: a checked
    custom loss). Requests of one :meth:`pack_key` can share a pass."""

    adapter: str
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: Optional[dict[str, float]] = None
    backward: bool = True
    graph: Optional[LossGraph] = None

    def tokens(self) -> int:
        """What the request is charged as in a shared pass: its tokens, and a custom loss's estimate per datum."""
        return sum(len(d) for d in self.datums) + (self.graph.datum_cost * len(self.datums) if self.graph else 0)

    def pack_key(self) -> Optional[tuple]:
        """Requests with equal keys can share a pass: the same gradient mode and the same kind of targets
        (one target a position, or K). None: runs alone (images: a vision tower's rows are not the batch's)."""
        if any(d.images for d in self.datums):
            return None
        first = self.datums[0].target_k
        return self.backward, (len(first[0]) if first else None)
