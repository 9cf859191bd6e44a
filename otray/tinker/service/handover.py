"""A live model's training calls handed to its learner in order, the next before the last is answered, and sent
again in that order when the learner dies under them.

The :class:`~otray.tinker.service.futures.OrderedExecutor` runs a model's requests in ``seq_id`` order. A
training call (forward_backward, optim_step, or both as one) need not wait for the answer of the one before it:
the learner's queue runs a client's calls in the order they came, and so does
:class:`~otray.tinker.service.learner_calls.LearnerCalls` on the way, so the next is handed over while the last
is on the learner (up to ``scheduling.calls_ahead`` unanswered). A client that sends its next step before
awaiting this one (tinker-cookbook's loop) then has it on the learner when this one ends, instead of one round
trip later, when the answer has reached the service (17% of the shared learner's time idle with 8 such clients,
NOTES issue 53). The answers are still read, recorded and given in order.

Two things the learner's death must not break, with calls on their way:

- Order. A call is handed over with the deaths of its learner known then (``seen``); a call sent ahead of
  unanswered ones takes the oldest ``seen`` of theirs. When it leaves for the learner, LearnerCalls asks
  :meth:`Handover._learner`, which refuses it (as lost, :class:`AdapterGone`) if the learner died since: so it
  never reaches a rebuilt learner before a call ahead of it that was lost is sent again. A lost call is sent
  again (:meth:`Handover.answer`) once its model is rebuilt and only when the calls before it were answered.
- Restore points. After an optim_step that takes a replay log past its bound, the service saves the adapter as
  the log's new start (:meth:`Healing.snapshot`); a call on the learner before that save would be in it and in
  the new log too. So a call does not go ahead of calls whose recording saves one (:meth:`Handover.may_follow`,
  :meth:`Healing.due`).

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from otray.tinker.errors import AdapterGone
from otray.tinker.learner.calls import LearnerCall
from otray.tinker.service.healing import Healing, Pass, Step, learner_lost
from otray.tinker.service.learner_calls import LearnerCalls

@dataclass
class Sent:
    """A training call of ``model_id`` handed to the learner of ``base``; ``seen``: that learner's deaths known
    when it was (last) handed over; ``answer``: its answer to come (its result, or the exception it raised)."""

    model_id: str
    base: str
    call: LearnerCall
    seen: int
    answer: asyncio.Future = field(repr=False, default=None)  # type: ignore[assignment]


class Handover:
    """The training calls of the live models (``calls``: each base's LearnerCalls; ``learner_of(model_id)``: its
    learner, raising when the model is not live; ``base_of(model_id)``: its base, None when not live)."""

    def __init__(self, healing: Healing, calls: dict[str, LearnerCalls], learner_of: Callable[[str], Any],
                 base_of: Callable[[str], Optional[str]]):
        self.healing, self.calls, self.learner_of, self.base_of = healing, calls, learner_of, base_of

    def may_follow(self, model_id: str, ahead: Sequence[tuple[Union[Pass, Step], int]]) -> bool:
        """Whether a call of ``model_id`` may go to the learner while calls that record ``ahead`` (with their
        replay sizes) are unanswered: not when recording them saves a restore point."""
        return not self.healing.due(model_id, ahead)

    async def hand(self, model_id: str, call: LearnerCall, check: Optional[asyncio.Future],
                   after: Sequence[Sent] = ()) -> Sent:
        """``call`` handed over, once ``check`` (its lease check) passed, behind ``after`` (the model's calls handed
        over before it and not answered yet): raises when the check fails or the model is not live."""
        if check is not None:
            await check
        self.learner_of(model_id)
        base = self.base_of(model_id) or ""
        if after:
            seen = min(s.seen for s in after)
        else:
            await self.healing.ready(base)  # a call sent before a healing ends would find no adapter
            self.learner_of(model_id)  # the healing may have ended it
            seen = self.healing.deaths.get(base, 0)
        sent = Sent(model_id, base, call, seen)
        sent.answer = self.calls[base].submit(call, lambda: self._learner(sent))
        return sent

    async def answer(self, sent: Sent) -> Any:
        """``sent``'s answer; if its learner died under it (or before it left), sent again once its model is
        rebuilt, as :meth:`Healing.call` sends any call: the caller reads the answers of a model's calls in order,
        so the calls lost with a learner go again in the order they were sent."""
        try:
            return await sent.answer
        except Exception as e:  # noqa: BLE001
            if not (self.healing.on and learner_lost(e) and self.base_of(sent.model_id) is not None):
                raise
        await self.healing.heal(sent.base, sent.seen)
        return await self.healing.call(sent.base, lambda: self._again(sent),
                                       lambda: self.base_of(sent.model_id) is not None)

    def _again(self, sent: Sent) -> asyncio.Future:
        """``sent`` handed over once more, to the learner as it is now (the model rebuilt)."""
        self.learner_of(sent.model_id)  # not rebuilt: ended with the reason, which this raises
        sent.seen = self.healing.deaths.get(sent.base, 0)
        sent.answer = self.calls[sent.base].submit(sent.call, lambda: self._learner(sent))
        return sent.answer

    def _learner(self, sent: Sent) -> Any:
        """The learner ``sent`` goes to now (LearnerCalls asks as it sends it); refused as lost if the learner died
        since ``sent`` was handed over (it goes again, in order, :meth:`answer`)."""
        handle = self.learner_of(sent.model_id)
        if self.healing.deaths.get(sent.base, 0) != sent.seen:
            raise AdapterGone(f"{sent.model_id}: its learner died after this call was handed over; it is sent "
                              "again once the model is rebuilt")
        return handle
