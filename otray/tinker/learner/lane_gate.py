"""LaneGate: a side-lane call computes alone; the main lane's pass waits at its next LoRA layer meanwhile.

The fair queue's side lane (:mod:`otray.tinker.learner.side_lane`) runs a small user's step on a second compute
thread beside a busy user's pass. Both threads are in one process and share its GIL, and a small model's pass is
mostly Python between short kernels, so the two passes took turns op by op: beside 256-token slices of the tiny
model, a one-datum pass on the side lane took 30 ms, three times its 10 ms alone, and the small user's step 1.65x
his time alone (session 64, ``benchmarks/learner_fairness.py``). With the gate, while a side call runs, the main
lane's compute thread waits at its next checkpoint (each LoRA layer's forward, and its backward where the backward
runs on that thread: on the CPU; a GPU's autograd runs backward on a device thread, which never waits) until
the side call ends; the side call then has the interpreter to itself. The main lane loses the side call's seconds
(a pausing small user's few percent); :attr:`LaneGate.paused_s` says how long it waited, so the fair queue
charges the main call its own seconds only.

Runs in the SharedLearner actor of one base model (its compute threads)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional


class LaneGate:
    """Owned by the learner's :class:`~otray.tinker.learner.adapter_learner.AdapterLearner`: its routed passes
    call :meth:`checkpoint`; the SharedLearner names the main lane's thread (:meth:`bind_main`) and runs each
    side call inside :meth:`side`. ``limit_s``: the longest one wait (then the pass goes on beside the side call,
    as without the gate: the two lanes' passes are correct side by side, only slower)."""

    def __init__(self, limit_s: float = 1.0):
        self.busy = False  # a side call is running (read at every checkpoint: one attribute, no lock)
        self._idle = threading.Event()
        self._idle.set()
        self.main: Optional[int] = None  # the thread that waits (None: no thread waits)
        self.limit_s = limit_s
        self.paused_s = 0.0  # seconds the main lane waited, since the start (only its thread adds to it)
        self.waits = 0
        self._since: Optional[float] = None  # when the main lane's wait now going on began

    def bind_main(self) -> None:
        """The calling thread is the main lane's: the one thread that waits at checkpoints."""
        self.main = threading.get_ident()

    @contextmanager
    def side(self) -> Iterator[None]:
        """A side call runs inside: the main lane waits at its next checkpoint until it ends."""
        self._idle.clear()
        self.busy = True
        try:
            yield
        finally:
            self.busy = False
            self._idle.set()

    def on_grad(self, grad: Any) -> None:
        """A tensor hook (a LoRA layer's output): its gradient's arrival is a checkpoint; the gradient unchanged."""
        self.checkpoint()

    def checkpoint(self) -> None:
        """On the main lane's thread, while a side call runs: wait for it to end (at most ``limit_s``)."""
        if self.busy and threading.get_ident() == self.main:
            self._since = t0 = time.perf_counter()
            self._idle.wait(self.limit_s)
            self.paused_s += time.perf_counter() - t0
            self._since = None
            self.waits += 1

    def paused_now(self) -> float:
        """:attr:`paused_s` with the wait going on now (read from another thread: the fair queue's)."""
        since = self._since
        return self.paused_s + (time.perf_counter() - since if since is not None else 0.0)
