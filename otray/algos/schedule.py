"""RL's learning rate at each step (``algo.lr_schedule``, ``algo.lr_warmup_steps``). Pure; runs in the job driver.

``learning_rate(algo, step)`` is the rate of RL step ``step`` (1-based) of ``algo.steps``: a linear
warm-up from ``lr/warmup`` to ``lr`` over the first ``lr_warmup_steps`` steps, then ``constant`` (lr),
``linear`` (down to ``lr / n`` at the last of the ``n`` steps after the warm-up: every step still learns) or
``cosine`` (down to :data:`COSINE_FLOOR` x lr at the last step).
"""

from __future__ import annotations

import math

from otray.config import AlgoSection

COSINE_FLOOR = 0.1  # cosine ends at this fraction of algo.learning_rate, not at 0 (the last steps still learn)


def learning_rate(algo: AlgoSection, step: int) -> float:
    """The learning rate of RL step ``step`` (1-based)."""
    lr, warm = algo.learning_rate, algo.lr_warmup_steps
    if warm and step <= warm:
        return lr * step / warm
    if algo.lr_schedule == "constant":
        return lr
    span = max(1, algo.steps - warm)  # the steps after the warm-up
    if algo.lr_schedule == "linear":
        return lr * max(1, span - (step - warm - 1)) / span
    done = min(1.0, max(0, step - warm - 1) / max(1, span - 1))  # 0 right after the warm-up, 1 at the last step
    return lr * (COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * done)))
