"""Episodes after the agent loop: their rewards, their metrics, where their tasks come from, and the log.

Pure helpers shared by training and inference jobs (no Ray): the env's reward
semantics (:func:`episode_reward`), what counts as solved, the metrics of a set of
episodes, loading an env's (or SFT chat data's) splits, and :class:`EpisodeLog`, which
appends a few decoded episodes per step to ``trajectories.jsonl`` and keeps them for
the ResourceManager (the dashboard's trajectory viewer).
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otray import metric_keys as K
from otray.config import DatasetSection, EnvSection, SplitSection
from otray.env import TaskSource, split_seed
from otray.structured import import_object
from otray.types import DatasetError, Task, Trajectory


LOGGED_IMAGE_BYTES = 512 * 1024  # an episode's images shown in the trajectory viewer, at most (encoded bytes)

REDUCE: dict[str, Callable[[list[float]], float]] = {
    "sum": sum, "mean": statistics.fmean, "max": max, "min": min}


def episode_reward(traj: Trajectory, env: EnvSection) -> float | None:
    """The episode's reward: ``env.reward_reduction`` over the turns' rewards that are not None, with
    ``env.nonterminal_reward`` as one more value when the episode did not finish (the env ended it
    unfinished, or a limit truncated it). None when there is no value at all: the rollout gave no
    reward and counts as failed. An errored episode gets 0.0 (it is failed already)."""
    if traj.error is not None:
        return 0.0
    values = [r for r in traj.turn_rewards if r is not None]
    if not traj.finished and env.nonterminal_reward is not None:
        values.append(env.nonterminal_reward)
    return REDUCE[env.reward_reduction](values) if values else None


def solved(traj: Trajectory) -> bool:
    """An episode counts as solved when the env says ``info["correct"]``, else when rewarded."""
    return bool(traj.info.get("correct", traj.reward > 0))


def episode_metrics(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """Mean reward, success rate, mean turns, error count; for tool envs (``info["tool_calls"]``), tool
    calls per episode and the share of them that failed; for envs that count invalid actions
    (``info["invalid_actions"]``: text games, the gymnasium adapter), invalid actions per turn."""
    out = {prefix + K.REWARD_MEAN: statistics.fmean(t.reward for t in trajs),
           f"{prefix}success_rate": statistics.fmean(map(solved, trajs)),
           f"{prefix}turns_mean": statistics.fmean(t.num_turns for t in trajs),
           f"{prefix}episode_errors": float(sum(t.error is not None for t in trajs))}
    calls = sum(int(t.info.get("tool_calls", 0)) for t in trajs)
    if any("tool_calls" in t.info for t in trajs):
        out[f"{prefix}tool_calls_mean"] = calls / len(trajs)
        out[f"{prefix}tool_error_rate"] = sum(int(t.info.get("tool_errors", 0)) for t in trajs) / max(1, calls)
    if any("invalid_actions" in t.info for t in trajs):
        turns = sum(t.num_turns for t in trajs)
        out[f"{prefix}invalid_action_rate"] = sum(int(t.info.get("invalid_actions", 0)) for t in trajs) / max(1, turns)
    return out


def load_splits(name: str, dataset: DatasetSection, splits: dict[str, SplitSection], seed: int,
                where: str) -> dict[str, TaskSource]:
    """Task sources of one env (or of SFT chat data): explicit split paths, else the builder's output."""
    built: dict[str, Any] = {}
    if dataset.builder:  # kwargs: the builder's, else the generator's
        built = import_object(dataset.builder)(dataset.dir, **dataset.kwargs)
    sources = {}
    for split, sc in splits.items():
        if dataset.generator and not sc.path:
            make = functools.partial(import_object(dataset.generator), **dataset.kwargs)
            sources[split] = TaskSource.from_generator(make, sc.num_samples or 1000, name,
                                                       seed=split_seed(seed, split), shuffle=sc.shuffle)
            continue
        path = sc.path or built.get(split)
        if path is None:
            raise DatasetError(f"{where}.splits.{split} has no path and the dataset builder made no {split!r} split")
        sources[split] = TaskSource.from_file(path, name, limit=sc.num_samples, shuffle=sc.shuffle, seed=seed)
    return sources


def batch_digest(tasks: list[Task]) -> str:
    """A short fingerprint of a batch's task ids, to check that a resumed run draws the same data."""
    import hashlib

    return hashlib.sha1("\n".join(f"{t.env}/{t.id}" for t in tasks).encode()).hexdigest()[:12]


class EpisodeLog:
    """A few decoded episodes per step: appended to ``<job dir>/trajectories.jsonl`` and kept until
    :meth:`take` hands them over (the ResourceManager stores them for the trajectory viewer)."""

    def __init__(self, job_dir: Path):
        self.path = Path(job_dir) / "trajectories.jsonl"
        self.pending: list[dict[str, Any]] = []

    def add(self, step: int, trajs: list[Trajectory], advantage_of: dict[int, float]) -> None:
        """Log ``trajs`` at ``step``; ``advantage`` is null for episodes that were not trained on."""
        rows = [{"step": step, "task": t.task.id, "env": t.task.env, "agent": t.agent_id,
                 "messages": t.messages, "turn_rewards": t.turn_rewards, "reward": t.reward,
                 "advantage": advantage_of.get(id(t)), "finished": t.finished, "truncated": t.truncated,
                 "error": None if t.error is None else t.error.message,
                 "info": {k: v for k, v in t.info.items() if isinstance(v, (int, float, str, bool))},
                 **logged_images(t)} for t in trajs]
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        self.pending.extend(rows)

    def take(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out


def logged_images(traj: Trajectory, budget: int = LOGGED_IMAGE_BYTES) -> dict[str, Any]:
    """The episode's images for the log, in the order their ``<image>`` markers appear in its messages:
    ``images`` (data URLs, up to ``budget`` encoded bytes in all) and ``images_omitted`` (how many of the
    rest did not fit). Nothing for a text episode."""
    if not traj.images:
        return {}
    shown, used = [], 0
    for image in traj.images:
        if used + len(image.data) > budget:
            break
        shown.append(image.data_url())
        used += len(image.data)
    return {"images": shown, "images_omitted": len(traj.images) - len(shown)}
