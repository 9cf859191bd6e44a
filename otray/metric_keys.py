"""The names of the metrics every job row carries, defined once.

A job writes rows (``metrics.jsonl``, the registry, wandb, Ray gauges); the CLI's table, ``otray
jobs``, the dashboard (served to its JavaScript by ``/api/info``, not retyped there) and the
summaries read them back. Every key that is written in one place and read in another is named here;
keys only one module writes and nobody reads by name (an env's own ``env/<name>/...``) stay there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STEP = "step"  # the optimizer step the row follows (0: before training)
PHASE = "phase"  # one of PHASES
REWARD_MEAN = "reward_mean"  # mean episode reward of the step's training rollouts
LOSS = "loss"  # the learner's loss (SFT steps, Tinker training clients)
EVAL_ACCURACY = "eval/accuracy"  # the headline held-out figure: success rate over the eval split
EVAL_STDERR = "eval/accuracy_stderr"  # its standard error (binomial, over the eval episodes)
# RL eval rows: eval/accuracy minus the held-out score RL started from (after the warm-up); and a warning
# when it has stayed more than that start's standard error below it at two evals in a row (or fell far at one)
EVAL_CHANGE = "eval/change_from_start"
EVAL_WARNING = "eval/warning"
ELO_PREFIX = "elo/"  # elo/<player>: a game job's Elo table after each eval (otray/algos/ratings.py)
EVAL_SFT_LOSS = "eval/sft_loss"  # held-out loss of an SFT job without envs
TOKENS_PER_S = "tokens_per_s"
STEP_S = "step_s"  # the step's seconds as the job measured its parts
STEP_WALL_S = "step_wall_s"  # as the driver's loop saw it
POLICY_LAG = "policy_lag"
# the sampler/learner logprob gap on the step's trained tokens (the learner's forward vs the sampler's)
LOGPROB_DIFF_MAX = "rollout/logprob_diff_max"
LOGPROB_DIFF_MEAN = "rollout/logprob_diff_mean"
LOGPROB_KL = "rollout/logprob_kl"
WORKERS_REPLACED = "rollout/workers_replaced"  # dead rollout workers replaced in their bundles so far (a run's)
WEIGHT_SYNC = "weight_sync"  # the transport that took the step's weights to the workers (its time: sync_s)
SAMPLER = "sampler"  # what generated the step's samples: eager | compiled (the HF backend's), or the backend
SAMPLER_COMPILE_S = "sampler_compile_s"  # that sampler's warm-up when the job started (paid once, not in a step)
PEAK_GPU_GB = "learner/peak_gpu_gb"  # the learner's peak GPU memory in the step (GPU learners only)
TIME_PREFIX = "time/"  # time/<part>_s: a step's time parts (otray.timing)
GENERATE_SHARE = "time/generate_share"
LEARNER_IDLE_FRAC = "time/learner_idle_frac"
ROLLOUT_IDLE_FRAC = "time/rollout_idle_frac"

# base: before the SFT warm-up; sft: after it (or an SFT job's step); init: before RL without warm-up;
# grpo: an RL step; infer: an inference job's one row; tinker: a Tinker training client's optim_step;
# recovery: the ResourceManager restarted the job after a failure (job.max_failures), from step STEP
PHASE_BASE, PHASE_SFT, PHASE_INIT, PHASE_GRPO = "base", "sft", "init", "grpo"
PHASE_INFER, PHASE_TINKER, PHASE_RECOVERY = "infer", "tinker", "recovery"
PHASES = (PHASE_BASE, PHASE_SFT, PHASE_INIT, PHASE_GRPO, PHASE_INFER, PHASE_TINKER, PHASE_RECOVERY)
RECOVERY_FAILURE = "recovery/failure"  # which failure this was (1, 2, ...), of at most job.max_failures
RECOVERY_REASON = "recovery/reason"  # the failure, as its error is stored (Type: message)
RECOVERY_FROM = "recovery/resumed_from"  # the checkpoint step the job went on from (None: from the start)
# the rollout workers that died and were replaced in their bundles in a step, in words: a recovery row of its
# own (no restart, no RECOVERY_FAILURE), kept when a restart rewinds the rows; ``otray status`` lists it
RECOVERY_WORKERS = "recovery/workers"


def time_part(part: str) -> str:
    """The key of one time part: ``time/<part>_s``."""
    return f"{TIME_PREFIX}{part}_s"


def headline_reward(row: Mapping[str, Any]) -> float | None:
    """A row's training figure: the mean reward, else (SFT, Tinker) the loss."""
    return row.get(REWARD_MEAN, row.get(LOSS))


def headline_eval(row: Mapping[str, Any]) -> float | None:
    """A row's held-out figure: the eval accuracy, else (SFT without envs) the held-out loss."""
    return row.get(EVAL_ACCURACY, row.get(EVAL_SFT_LOSS))


def for_dashboard() -> dict[str, str]:
    """The keys the dashboard's page plots, as ``/api/info`` serves them to it."""
    return {"step": STEP, "reward": REWARD_MEAN, "loss": LOSS, "accuracy": EVAL_ACCURACY, "elo_prefix": ELO_PREFIX}
