"""The Tinker API's user errors, raised in any of its processes (the gateway's Serve replica, the
TinkerService actor, the learner actors) and carried back across Ray to the HTTP answer.

Runs in every process of the Tinker API."""

from __future__ import annotations


class UserError(ValueError):
    """A request the caller has to change; ``status`` is the HTTP status when it is refused at once.
    ``model_id`` / ``seq_id``: the ordered request it refused, where known (its seq_id is then used up,
    so the model's next request does not wait for it: ``Training.refused``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.model_id: str | None = None
        self.seq_id: int | None = None


class AdapterGone(KeyError):
    """A learner asked for an adapter it does not hold: the model was unloaded, or the learner restarted
    (the service then rebuilds the model: ``otray.tinker.service.healing``)."""


def unwrap(e: BaseException) -> BaseException:
    """The exception a service call raised inside its actor (Ray wraps it)."""
    cause = e
    while cause is not None:
        inner = getattr(cause, "cause", None)  # Ray's wrapper (itself a subclass of the error) -> the original
        if isinstance(inner, BaseException) and inner is not cause:
            cause = inner
        elif isinstance(cause, (UserError, PermissionError)):
            return cause
        else:
            cause = cause.__cause__
    return e
