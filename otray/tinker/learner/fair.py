"""Fair shares of a shared learner: whose work the learner does next.

Every training client and every learner-sampled request of one base model runs on one
:class:`~otray.tinker.learner.shared_learner.SharedLearner`, one step at a time. Run in arrival order, a user
who keeps ten clients busy with large batches had ten calls ahead of anyone else's one-datum step
(it waited 257x its time alone). A :class:`FairQueue` runs the steps instead, choosing the next by
start-time fair queueing over users:

- a *job* is one call of one client (a training client's adapter, or a user's sampling): a list of
  steps run in order, each one turn on the learner (a forward_backward is one step per slice of
  at most ``slice_tokens`` tokens, so a small step waits for one slice of another's work, not all;
  a step may answer :data:`~otray.tinker.learner.fair_jobs.AGAIN` to run once more in the job's next turn: a
  sampling call is decoded so, a turn at a time);
- a client's jobs run in the order they came (the service sends a model's requests in ``seq_id``
  order); its next job is ready the moment the previous one ends, so a pipelined ``optim_step``
  keeps the turn its ``forward_backward`` had, and a client whose next job usually comes within
  ``follow_s`` keeps its turn for it while owed it (:mod:`otray.tinker.learner.kept_turns`);
- each user has a virtual clock ``finish``: learner seconds used, divided by its ``weight``; the
  next step is the user's with the earliest ``max(V, finish)`` among those with work, ``V`` the start
  of the last step run (a user idle for a while starts at ``V``: no credit for time it did not ask
  for, so it cannot then hold the learner for long); a higher ``priority`` goes first while it has
  work (strict; weights within a level); a user's clients take turns, a step each.

Seconds are measured around each step, whatever it does (a slice, an optimizer step, a checkpoint,
a sample); a job that fails is also charged the steps it will not run, at the failed step's price (failing
early makes a large call no cheaper). ``policy: fifo`` runs jobs whole in arrival order (the behaviour before this module, kept
as the baseline ``benchmarks/tinker_fairness.py`` measures against).

Shared passes: a :class:`Packable` step (a forward_backward slice, an optimizer step) can share one
learner call with the next steps of other clients, the chosen one's included, of the same ``key``: taken
in the same fair order, each no bigger than the chosen step, up to ``pass_tokens`` tokens in all, and run
by the queue's ``pack`` function in one call. A small user's step then rides in the next pass instead of
waiting for a turn of its own; the pass's
seconds are charged to its users in proportion to their tokens. Only users of the chosen user's
priority ride along (a higher one would have been chosen).

Cohorts: N clients that each loop a forward_backward and its optim_step split, left alone, into two halves
that take turns (one half's pass runs while the other's optimizer steps and round trips happen), so a pass
held N/2 of them (session 38, on the CPU and an H200 alike). So before a shared pass the queue waits, up to
twice their last gap (and ``follow_s``), for the clients whose next step is due and would ride in it: of its
key and about its size (:meth:`FairQueue._await_riders`, :class:`Followers`); a busy user's slice does not wait
for a small user's step nor a small step for a big one, so fair shares are kept, and a pass holds all N
(session 43). With ``first_keys`` (the SharedLearner's ``wait_for_followers``), steps of those keys
(optimizer steps: milliseconds) go before the other steps of their priority, and after a shared call the
queue waits for the next jobs of all the call's clients whose next job usually comes that fast: it costs
fair shares (a busy user beside a small one that loops back to back kept 25% of its rate, 69% without), so
it is off unless an admin turns it on.

The side lane (``side_tokens``, :mod:`otray.tinker.learner.side_lane`): small steps of other clients on a
second compute thread, beside a packable step, so that they wait for no slice.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any, Awaitable, Callable, Hashable, Optional, Sequence, Union

from otray.tinker.config import Share
from otray.tinker.learner.fair_jobs import (Job, Member, Pack, Packable, Step, User, head, next_steps, run_call,
                                            slices, unrun)
from otray.tinker.learner.followers import Followers
from otray.tinker.learner.kept_turns import KeptTurns
from otray.tinker.learner.side_lane import SideLane

__all__ = ["FairQueue", "Packable", "slices"]


class FairQueue:
    """The learner's work, one step at a time (owned by the learner actor's event loop)."""

    def __init__(self, shares: dict[str, Share] | None = None, policy: str = "fair", follow_s: float = 0.05,
                 pack: Optional[Pack] = None, pass_tokens: int = 0, first_keys: Sequence[Hashable] = (),
                 side: Optional[Pack] = None, side_tokens: int = 0, paused: Callable[[], float] = lambda: 0.0):
        self.shares, self.policy, self.follow_s = shares or {}, policy, follow_s
        self.pack, self.pass_tokens = pack, pass_tokens  # shared passes (fair policy only); 0 tokens: none
        # small steps on a second compute thread beside a pass (``side`` runs a call's works there)
        # (``paused``: seconds the main lane has waited for side calls since the start, LaneGate's)
        self.side = SideLane(self, side, side_tokens if policy == "fair" else 0, paused)
        self.first_keys = frozenset(first_keys) if pack is not None and pass_tokens > 0 and policy == "fair" else frozenset()
        self.followers = Followers()
        self.turns = KeptTurns(self)  # turns kept for a client's next job (its round trip)
        self.running: set[int] = set()  # ids of the jobs whose step is on the learner now
        self.passes: list[int] = []  # steps per shared call, the latest 1,000 (tests)
        self.shared = {"calls": 0, "steps": 0}  # shared calls and the steps they held, since the start
        self.packed: dict[str, dict[str, int]] = {}  # by pack key: packable calls (one step or more) and their steps
        self.users: dict[str, User] = {}
        self.vtime = 0.0
        self.arrivals = itertools.count()
        self.busy = False
        self.pending = 0  # jobs not finished
        self.pending_by: dict[str, int] = {}  # of them, each user's
        self.used: dict[str, float] = {}  # learner seconds per user
        self.steps: dict[str, int] = {}  # steps run per user

    def others_wait(self, user: str) -> bool:
        """A job of a user other than ``user`` is not finished (two counts: safe to ask from another thread)."""
        return self.pending > self.pending_by.get(user, 0)

    def _done_by(self, user: str, jobs: int) -> None:
        self.pending_by[user] -= jobs
        if not self.pending_by[user]:
            del self.pending_by[user]

    def share(self, user: str) -> Share:
        return self.shares.get(user, Share())

    async def run(self, user: str, client: str, steps: Sequence[Union[Step, Packable]], follow: bool = False) -> list[Any]:
        """Run ``steps`` of ``client`` (``user``'s) in order, each in its turn; their results. A step that
        raises ends the job (its later steps do not run) and the exception is raised here. ``follow``:
        the client's next job is likely on its way (:meth:`KeptTurns.hold`)."""
        job = Job(deque(steps), asyncio.get_running_loop().create_future(), next(self.arrivals), follow)
        self.users.setdefault(user, User()).clients.setdefault(client, deque()).append(job)
        self.followers.arrived(user, client, head(steps))  # also wakes a held turn (Followers.wait)
        self.pending += 1
        self.pending_by[user] = self.pending_by.get(user, 0) + 1
        if not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._drain())
        self.side.kick()
        return await asyncio.shield(job.done)

    def free(self, u: User) -> list[str]:
        """``u``'s clients whose next job is not on the learner now (on the side lane)."""
        return [c for c, jobs in u.clients.items() if id(jobs[0]) not in self.running]

    def order_key(self, nu: tuple[str, User]) -> tuple:
        """Fair order of users: the top priority, then the earliest virtual start, then the earliest arrival."""
        return (-self.share(nu[0]).priority, max(self.vtime, nu[1].finish),
                min(jobs[0].arrival for jobs in nu[1].clients.values()))

    def _next(self) -> Optional[Member]:
        """The step to run now: the top priority, earliest virtual start; that user's first client (not one
        on the side lane: None when every waiting job is there)."""
        if self.policy == "fifo":
            return min(((n, u, c, jobs[0]) for n, u in self.users.items() for c, jobs in u.clients.items()),
                       key=lambda x: x[3].arrival)
        order = self.order_key
        free = [(n, u) for n, u in self.users.items() if self.free(u)]
        if not free:
            return None
        name, u = min(free, key=order)
        if self.first_keys:  # a quick step of the chosen priority first (the cohorts in the module's doc)
            level = self.share(name).priority
            quick = [(n, v, c, jobs[0]) for n, v in self.users.items() if self.share(n).priority == level
                     for c, jobs in v.clients.items() if jobs[0].steps and isinstance(jobs[0].steps[0], Packable)
                     and jobs[0].steps[0].key in self.first_keys and id(jobs[0]) not in self.running]
            if quick:
                return min(quick, key=lambda x: (order((x[0], x[1])), x[3].arrival))
        client = self.free(u)[0]
        return name, u, client, u.clients[client][0]

    async def _drain(self) -> None:
        try:
            while self.pending:
                first = self._next()
                if first is None:  # every waiting job is on the side lane: the main lane waits for its call
                    await self.side.call_ends()
                    continue
                name, u, client, job = first
                self.running.add(id(job))  # chosen: the side lane must not take it (call() clears the mark)
                self.vtime = max(self.vtime, u.finish)
                if self.side.beside(job.steps[0]):  # a big packable step: small ones may run beside it
                    self.side.open = True
                    self.side.kick()
                elif isinstance(job.steps[0], Packable):  # a small one: the side lane starts no call (its own may end)
                    self.side.open = False
                else:  # not packable (a sample, a checkpoint, an adapter made or dropped): the side lane ends first
                    await self.side.close()
                if job.steps:
                    await self._await_riders(first)
                if not job.steps:  # withdrawn while it waited (its model was unloaded): nothing to run
                    self.running.discard(id(job))
                    self._advance(name, u, client, job)
                    continue
                members = [first, *self._riders(first)]
                steps = [m[3].steps[0] for m in members]
                if isinstance(steps[0], Packable):
                    count = self.packed.setdefault(str(steps[0].key), {"calls": 0, "steps": 0})
                    count["calls"], count["steps"] = count["calls"] + 1, count["steps"] + len(steps)
                await self.call(members, lambda: run_call(self.pack, steps))
                if self.first_keys and isinstance(steps[0], Packable):
                    await self._gather([(m[0], m[2]) for m in members if not m[3].steps])
                elif not job.steps and self.pending and self.policy == "fair":
                    await self.turns.hold(name, client, job.follow)
        except Exception as e:  # a fault of the queue itself: every waiting caller learns it (none hangs)
            self.fail_all(e)
            raise
        finally:
            self.busy = False
            self.side.open = False

    async def call(self, members: list[Member], run: Callable[[], Awaitable[list[Any]]], main: bool = True) -> None:
        """Run one learner call for ``members`` (their next steps) and settle each: charged its share of the call's
        seconds by tokens (on the main lane less the seconds it waited for side calls: ``main``), its result or
        exception given, its job advanced."""
        steps = [m[3].steps[0] for m in members]
        tokens = [s.tokens if isinstance(s, Packable) else 1 for s in steps]
        ids = {id(m[3]) for m in members}
        self.running.update(ids)
        t0 = time.monotonic()
        if main:
            self.side.main_starts(self.share(members[0][0]).weight)
        try:
            outcomes = await run()  # a job withdrawn meanwhile has no steps left after it
        finally:
            self.running.difference_update(ids)
            waited = self.side.main_ends() if main else 0.0
        spent = max(time.monotonic() - t0 - waited, 0.0)
        for (n, mu, c, mjob), outcome, t in zip(members, outcomes, tokens):
            share = spent * t / sum(tokens)  # a shared pass is charged by tokens
            mu.finish = max(self.vtime, mu.finish) + (share + self.turns.due.pop(n, 0.0)) / self.share(n).weight
            self.used[n] = self.used.get(n, 0.0) + share
            self.steps[n] = self.steps.get(n, 0) + 1
            left = mjob.took(outcome)
            if left and sum(o is outcome for o in outcomes) == 1:  # unless the call failed as a whole
                mu.finish += unrun(left, share, spent / sum(tokens)) / self.share(n).weight
            self._advance(n, mu, c, mjob)

    def fail_all(self, error: Exception) -> None:
        for u in self.users.values():
            for jobs in u.clients.values():
                for j in jobs:
                    j.fail(error)
        self.users.clear()
        self.pending = 0
        self.pending_by.clear()
        self.running.clear()

    def _riders(self, first: Member) -> list[Member]:
        """The steps that share ``first``'s pass: other clients' next steps of its key, in fair order, within
        ``pass_tokens`` (none unless ``first``'s step is packable and the policy fair). A step rides only on
        a step at least as big as itself: a small user's step rides in a busy user's pass, but a busy user's
        slice does not make the small user's own pass longer (on a compute-bound learner it would: the small
        step then waited for two slices, not one)."""
        head = first[3].steps[0]
        if not isinstance(head, Packable) or self.pack is None or self.policy != "fair" or self.pass_tokens <= 0:
            return []
        level = self.share(first[0]).priority
        users = sorted(((n, u) for n, u in self.users.items() if u.clients and self.share(n).priority == level),
                       key=self.order_key)
        # (``first`` itself is among the running jobs: not taken again)
        out = next_steps(users, self.running, self.pass_tokens - head.tokens, head.tokens, head.key)
        if out:
            self.passes = [*self.passes[-999:], 1 + len(out)]
            self.shared["calls"] += 1
            self.shared["steps"] += 1 + len(out)
        return out

    def withdraw(self, user: str, client: str, error: Exception) -> int:
        """Fail ``client``'s queued jobs with ``error`` (its model was unloaded: cancelled or expired), so
        none of their steps reaches the learner; a job whose step is on the learner now ends with that
        step. Returns the jobs withdrawn."""
        self.followers.forget(user, client)
        u = self.users.get(user)
        jobs = u.clients.get(client) if u else None
        if not jobs:
            return 0
        kept = deque(j for j in jobs if id(j) in self.running)
        for j in jobs:
            j.fail(error)  # the running one: its step on the learner is its last
        gone = len(jobs) - len(kept)
        self.pending -= gone
        self._done_by(user, gone)
        if kept:
            u.clients[client] = kept
        else:
            del u.clients[client]
            if not u.clients and u.finish <= self.vtime:
                del self.users[user]
        return gone

    def _advance(self, name: str, u: User, client: str, job: Job) -> None:
        """After a step: a finished job leaves; the client goes to the back of its user's turns."""
        jobs = u.clients.pop(client)
        if not job.steps:
            jobs.popleft()
            self.pending -= 1
            self._done_by(name, 1)
            self.followers.finished(name, client)
            if not job.done.done():
                job.done.set_result(job.results)
        if jobs:
            u.clients[client] = jobs
        if not u.clients and u.finish <= self.vtime:  # nothing to remember: it would start at V anyway
            del self.users[name]

    async def _await_riders(self, first: Member) -> None:
        """Before a shared pass, wait for the due clients whose next step would ride in it (:meth:`Followers.riders`):
        clients looping alike share each pass, not cohorts taking turns (not with ``first_keys``: it gathers)."""
        head = first[3].steps[0]
        if not isinstance(head, Packable) or self.pack is None or self.policy != "fair" or self.pass_tokens <= 0 \
                or self.first_keys:
            return
        queued = lambda n, c: n in self.users and c in self.users[n].clients  # noqa: E731
        due = self.followers.riders((head.key, head.tokens), self.pass_tokens - head.tokens, self.follow_s,  # (a queued one: no wait)
                                    lambda nc: self.share(nc[0]).priority == self.share(first[0]).priority)
        if due:
            await self.followers.wait(lambda: all(queued(n, c) for n, c in due), max(due.values()))

    async def _gather(self, clients: list[tuple[str, str]]) -> None:
        """After a shared call: wait for the next jobs of those ``clients`` (user, client) whose next job came
        within ``follow_s`` last time, up to twice the slowest of their gaps (and ``follow_s``), so they share the
        next call instead of forming a cohort of their own. A wait that a client does not end is charged to its
        user, as a kept turn is (:meth:`KeptTurns.hold`)."""
        late, waited = await self.followers.gather(clients, self.follow_s,
                                                   lambda n, c: n in self.users and c in self.users[n].clients)
        for n, _ in late:
            if n in self.users:
                self.users[n].finish += waited / len(late) / self.share(n).weight
