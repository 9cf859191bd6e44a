"""Trajectories -> learner datums (the shift by one, masks, aligned logprobs).

For a sequence ``seq`` of length L the learner predicts token ``t+1`` from the
prefix ending at ``t``; so ``input_ids = seq[:-1]`` and every per-token field
describes the *target* ``seq[1:]``: its loss mask, its sampler logprob, its
advantage. A sampled first token cannot be a target (nothing precedes it), which
never happens because every episode starts with a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from otray.types import Datum, Trajectory


def trajectory_to_datum(traj: Trajectory, advantage: float) -> Datum:
    """One trajectory with one scalar advantage spread over its sampled tokens."""
    seq = traj.token_ids
    if len(seq) < 2:
        raise ValueError("a trajectory needs at least two tokens to make a datum")
    mask = [float(m) for m in traj.loss_mask[1:]]
    return Datum(
        input_ids=list(seq[:-1]),
        target_ids=list(seq[1:]),
        mask=mask,
        advantages=[advantage * m for m in mask],
        sampler_logprobs=list(traj.logprobs[1:]),
    )


def build_datums(trajs: Sequence[Trajectory], advantages: Sequence[float]) -> list[Datum]:
    """Datums for the trajectories that sampled anything (errors with no tokens drop out)."""
    return [
        trajectory_to_datum(t, a)
        for t, a in zip(trajs, advantages, strict=True)
        if t.num_sampled > 0 and len(t.token_ids) >= 2
    ]


def sft_datum(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> Datum:
    """A supervised datum: cross-entropy on the completion tokens only."""
    traj_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    seq = list(prompt_ids) + list(completion_ids)
    mask = [float(m) for m in traj_mask[1:]]
    return Datum(
        input_ids=seq[:-1],
        target_ids=seq[1:],
        mask=mask,
        advantages=[0.0] * len(mask),
        sampler_logprobs=[0.0] * len(mask),
        weights=list(mask),
    )
