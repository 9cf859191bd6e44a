"""Where a step's time goes.

``StepClock`` splits one step's wall time (the driver's clock) into consecutive named
parts: ``clock.mark("forward_backward")`` ends the part that began at the previous
mark. The parts sum to the step's wall time by construction; what they say is which
part holds the time. ``BusyClock`` lives in an actor and adds up the seconds the actor
spends computing, so the driver can tell how much of a step each actor sat idle.

Parts of an RL step (metrics ``time/<part>_s``):

- ``sample``: drawing the step's tasks from the mixture;
- ``generate``: waiting on rollout workers' generate calls (the agent loop's calls);
- ``env``: the rest of the rollout: env resets and steps, rendering, tokenizing, rewards;
- ``rollout_wait`` (one-step-off-policy only): waiting for the next batch, generated
  in the background while the learner trained, to finish;
- ``prepare``: dropping groups, advantages, building datums;
- ``forward_backward``, ``optim_step``: the learner calls, including transport;
- ``weight_sync``: pushing the new weights to every rollout worker;
- ``other``: the fleets' health check before the step, metrics, logging, reading the actors' busy clocks.

There is no reference- or old-logprob pass: the loss uses the sampler's logprobs as the
behaviour policy's (``q`` in ARCHITECTURE.md), and no KL-to-reference term exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from otray import metric_keys as K


class StepClock:
    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def mark(self, part: str) -> float:
        """End the current part, naming it ``part`` (repeated names add up); returns its seconds."""
        now = time.perf_counter()
        took, self.last = now - self.last, now
        self.parts[part] = self.parts.get(part, 0.0) + took
        return took

    def add(self, part: str, seconds: float, out_of: str) -> None:
        """Move ``seconds`` of part ``out_of`` into ``part`` (e.g. generate out of the rollout)."""
        seconds = min(seconds, self.parts.get(out_of, 0.0))
        self.parts[out_of] = self.parts.get(out_of, 0.0) - seconds
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def metrics(self, learner_busy_s: float | None = None, rollout_busy_s: list[float] | None = None,
                generate_s: float | None = None) -> dict[str, float]:
        """``time/<part>_s`` for every part, ``step_s`` (the step so far), the generation share of the
        step, and, given the actors' busy seconds during the step, their idle fractions."""
        step = self.elapsed  # measured on its own: the parts should add up to it
        out = {K.time_part(k): v for k, v in self.parts.items()}
        out[K.STEP_S] = step
        gen = self.parts.get("generate", 0.0) if generate_s is None else generate_s
        out[K.GENERATE_SHARE] = gen / max(step, 1e-9)
        if learner_busy_s is not None:
            out[K.LEARNER_IDLE_FRAC] = max(0.0, 1 - learner_busy_s / max(step, 1e-9))
        if rollout_busy_s:
            out[K.ROLLOUT_IDLE_FRAC] = max(0.0, 1 - sum(rollout_busy_s) / len(rollout_busy_s) / max(step, 1e-9))
        return out


class BusyClock:
    """Seconds an actor spent inside its working methods, summed since it started."""

    def __init__(self) -> None:
        self.total = 0.0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total += time.perf_counter() - t0


def busy(method):
    """Count a method's seconds in its object's ``busy`` BusyClock (actors' working methods)."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.busy():
            return method(self, *args, **kwargs)

    return wrapper


PARTS = ("sample", "generate", "env", "rollout_wait", "prepare", "forward_backward", "optim_step", "weight_sync", "other")


def breakdown_table(rows: list[dict]) -> str:
    """``otray metrics JOB --breakdown``: each RL step's time parts (seconds) and idle fractions."""
    head = ["step", "step_s", *PARTS, "gen_share", "learner_idle", "rollout_idle"]
    lines = ["  ".join(f"{h:>12}" if i > 1 else f"{h:>6}" for i, h in enumerate(head))]
    for r in rows:
        if K.GENERATE_SHARE not in r:
            continue
        cells = [f"{r[K.STEP]:>6}", f"{r[K.STEP_S]:>6.2f}"]
        cells += [f"{r.get(K.time_part(p), 0.0):>12.3f}" for p in PARTS]
        cells += [f"{r.get(k, float('nan')):>12.2f}" for k in
                  (K.GENERATE_SHARE, K.LEARNER_IDLE_FRAC, K.ROLLOUT_IDLE_FRAC)]
        lines.append("  ".join(cells))
    return "\n".join(lines)
