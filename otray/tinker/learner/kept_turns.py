"""Turns kept for a client whose next job is on its way: the fair queue idles a moment rather than give the
turn away at the client's round trip.

A client's pipelined ``optim_step`` keeps the turn its ``forward_backward`` had, and a client that loops (its next
job came within ``follow_s`` last time) keeps its turn across the round trip while it is owed it. Without that a
looping user lost its turn at each round trip: ~35% of the learner beside a busy one, not half
(``benchmarks/custom_loss_bound.py``). A kept turn is charged to its user as learner time.

Users who all loop alike lose their turns at their round trips alike, so among them a turn is kept only for a
user that leads the others by more than the learner would idle: eight equal users looping one-datum steps, a
pass each, kept 15-22% of the learner idle for leads of 1.5 ms (median) and ran at 0.94x the steps a second
(session 69: ``benchmarks/tinker_shared_passes.py --modes own,own_kept``; NOTES, issue 53).

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import time
from typing import Protocol

from otray.tinker.config import Share
from otray.tinker.learner.fair_jobs import User
from otray.tinker.learner.followers import Followers


class Queue(Protocol):
    """What the kept turns read of their :class:`~otray.tinker.learner.fair.FairQueue`."""

    users: dict[str, User]
    vtime: float
    follow_s: float
    followers: Followers

    def share(self, user: str) -> Share: ...


class KeptTurns:
    """The turns ``queue`` (which owns this, on the learner actor's event loop) keeps for its clients' next jobs;
    ``due``: by user, the seconds of a kept turn that its next job came in, charged with that job's step."""

    def __init__(self, queue: Queue):
        self.queue = queue
        self.due: dict[str, float] = {}

    async def hold(self, name: str, client: str, follow: bool) -> None:
        """A job of ``client`` ended. If its next job is likely on its way (``follow``: a forward_backward's
        optim_step, kept up to ``follow_s``; or its last next job came within ``follow_s``, a loop of steps, kept up
        to twice that gap) and that user is owed the next turn, keep the turn for it, unless the others loop alike
        (:meth:`alike`) and it leads them by less than that gap in its own learner seconds (:meth:`lead`, so
        weights still hold among them). A kept turn is charged to that user as learner time: at once when no job
        came, else with that job's step (uncharged, a looping user took it on top of its half: busy alice 44%)."""
        q = self.queue
        within = q.follow_s if follow else q.followers.window(name, client, q.follow_s)
        if within is None or not (follow or self.owed(name)):
            return
        if not follow and self.alike(name) and self.lead(name) * q.share(name).weight < q.followers.gap[(name, client)]:
            return  # the others lose their turns as it would, and it leads them by less than the learner would idle
        t0 = time.monotonic()
        await q.followers.wait(lambda: not self.owed(name) or client in q.users[name].clients, t0 + within)
        waited, u = time.monotonic() - t0, q.users.get(name)
        if u is not None and client in u.clients:
            self.due[name] = self.due.get(name, 0.0) + waited
        elif u is not None:
            u.finish += waited / q.share(name).weight

    def alike(self, name: str) -> bool:
        """Every other user with work waiting at ``name``'s priority loops as a client of one-slice calls does:
        one client, whose next job came within ``follow_s`` last time, with at most two steps waiting (a
        forward_backward slice and its optim_step). Each of them loses its turn at its round trip as ``name``
        would, so keeping ``name``'s idles the learner and keeps no share. A user with several clients, or a call
        of several slices waiting, does not lose its turn so and would take a looping user's share."""
        q = self.queue
        level = q.share(name).priority
        for n, u in q.users.items():
            if n == name or not u.clients or q.share(n).priority != level:
                continue
            if len(u.clients) > 1:
                return False
            (client, jobs), = u.clients.items()
            if q.followers.window(n, client, q.follow_s) is None or sum(len(j.steps) for j in jobs) > 2:
                return False
        return True

    def lead(self, name: str) -> float:
        """How far (virtual seconds) ``name``'s virtual start is before the earliest of the other users with work
        waiting at its priority, for a user :meth:`owed` the turn: what it would lose if one of them took the turn
        and it came back after. Eight equal users looping one-datum steps: 1.5 ms median, their turns kept 6.6 ms
        median (session 69)."""
        q, mine = self.queue, self.queue.users[name]
        level = q.share(name).priority
        others = [max(q.vtime, u.finish) for n, u in q.users.items()
                  if n != name and u.clients and q.share(n).priority == level]
        return min(others) - max(q.vtime, mine.finish) if others else float("inf")

    def owed(self, name: str) -> bool:
        """``name`` would be chosen next over every other user with work waiting."""
        q, mine = self.queue, self.queue.users.get(name)
        others = [(n, u) for n, u in q.users.items() if n != name and u.clients]
        if mine is None or not others:
            return False
        tag = (-q.share(name).priority, max(q.vtime, mine.finish))
        return all(tag <= (-q.share(n).priority, max(q.vtime, u.finish)) for n, u in others)
