"""What the service asks of a :class:`~otray.tinker.learner.shared_learner.SharedLearner` in a training call:
one client's forward(_backward) (:class:`PassCall`), optim_step (:class:`StepCall`) or both (:class:`PairCall`),
each naming its user. The service sends small ones of several clients together, as one
:meth:`SharedLearner.calls` (:mod:`otray.tinker.service.learner_calls`). Plain data without torch.

Runs in the SharedLearner actor of one base model (and is imported by the TinkerService, which sends it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from otray.tinker.learner.passes import PassRequest
from otray.tinker.learner.specs import AdamStep


@dataclass(frozen=True)
class PassCall:
    """``user``'s forward(_backward) request: its adapter, datums and loss (``request.adapter``: the model id)."""

    user: str
    request: PassRequest

    def tokens(self) -> int:
        return self.request.tokens()

    def client(self) -> tuple[str, str]:
        """(user, model id): whose call it is."""
        return self.user, self.request.adapter


@dataclass(frozen=True)
class StepCall:
    """``user``'s optim_step of ``adapter``."""

    user: str
    adapter: str
    step: AdamStep

    def tokens(self) -> int:
        return 1

    def client(self) -> tuple[str, str]:
        return self.user, self.adapter


@dataclass(frozen=True)
class PairCall:
    """A forward_backward and the optim_step after it (answered as a ``TrainStepResult``: each part alone)."""

    first: PassCall
    step: AdamStep

    def tokens(self) -> int:
        return self.first.tokens() + 1

    def client(self) -> tuple[str, str]:
        return self.first.client()


LearnerCall = Union[PassCall, StepCall, PairCall]
