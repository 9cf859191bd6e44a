"""The held-out guard of an RL job: is RL losing what the job started with? Runs in the job driver.

:class:`HeldoutWatch` is given the eval row RL starts from (after the SFT warm-up, or before any
training) and every later eval row. It adds to each ``eval/change_from_start`` (held-out accuracy
minus the start's) and, once accuracy has been more than the start's standard error below the start
at ``patience`` evals in a row, ``eval/warning``: a sentence that ``otray train`` prints and the
job's log keeps, naming the figures and what to try (:func:`advice`: a pull towards the starting policy
when the job has none, a stronger one when it has). A fall of more than :data:`FAR` standard errors (at
least :data:`FAR_FLOOR`) warns at once: no noise does that, and a collapse at a job's last eval (calculator
35% -> 0% in one step, session 58) would otherwise end unwarned. One warning per run of such evals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from otray import metric_keys as K

FAR = 3.0  # standard errors below the start that warn at the first such eval
FAR_FLOOR = 0.05  # ... and never less than this (a start at 0% or 100% has a standard error of 0)


def advice(kl_coeff: float) -> str:
    """What to try when RL loses held-out accuracy, for a job whose pull to its starting policy is ``kl_coeff``."""
    pull = ("algo.kl_coeff > 0 (a pull towards the starting policy)" if not kl_coeff
            else f"a larger algo.kl_coeff (the pull towards the starting policy is {kl_coeff:g})")
    return ("RL is making held-out accuracy worse than where it started; try a lower algo.learning_rate, "
            f"{pull}, fewer algo.steps, or a warm-up that goes further (sft.stop_at_accuracy)")


@dataclass
class HeldoutWatch:
    start: float  # held-out accuracy RL started from
    stderr: float  # its standard error
    kl_coeff: float = 0.0  # the job's pull towards its starting policy (algo.kl_coeff as resolved)
    patience: int = 2  # evals in a row below start - stderr before the warning
    below: int = 0  # evals in a row below it so far
    warned: bool = False  # whether this run of such evals was warned about

    @classmethod
    def of(cls, row: dict[str, Any], kl_coeff: float = 0.0, patience: int = 2) -> HeldoutWatch | None:
        """A watch from the starting eval row; None when it has no held-out accuracy (e.g. an SFT job)."""
        if K.EVAL_ACCURACY not in row:
            return None
        return cls(float(row[K.EVAL_ACCURACY]), float(row.get(K.EVAL_STDERR, 0.0)), kl_coeff, patience)

    @classmethod
    def replay(cls, rows: list[dict[str, Any]], kl_coeff: float = 0.0, patience: int = 2) -> HeldoutWatch | None:
        """The watch as it stood after ``rows`` (a resumed job's ``metrics.jsonl``): from the last
        starting row (warm-up or init), having seen every eval after it."""
        starts = [i for i, r in enumerate(rows) if r.get(K.PHASE) in (K.PHASE_SFT, K.PHASE_INIT)]
        if not starts:
            return None
        watch = cls.of(rows[starts[-1]], kl_coeff, patience)
        for row in rows[starts[-1] + 1:] if watch is not None else ():
            watch.see(row)
        return watch

    def see(self, row: dict[str, Any]) -> dict[str, Any]:
        """What to add to a later row: nothing without an eval, else the change and, when due, the warning."""
        if K.EVAL_ACCURACY not in row:
            return {}
        now = float(row[K.EVAL_ACCURACY])
        out: dict[str, Any] = {K.EVAL_CHANGE: now - self.start}
        self.below = self.below + 1 if now < self.start - self.stderr else 0
        self.warned = self.warned and self.below > 0
        far = now < self.start - max(FAR * self.stderr, FAR_FLOOR)
        if not self.warned and (self.below >= self.patience or far):
            self.warned = True
            how = (f"at {self.patience} evals in a row" if self.below >= self.patience
                   else f"{(self.start - now) / max(self.stderr, 1e-9):.0f} times over" if self.stderr > 0
                   else "at once")
            out[K.EVAL_WARNING] = (
                f"held-out accuracy {now:.3f} at step {row.get(K.STEP)} is below the {self.start:.3f} RL started "
                f"from by more than its standard error ({self.stderr:.3f}) {how}. " + advice(self.kl_coeff))
        return out
