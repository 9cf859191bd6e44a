"""InferenceJob: batch inference with a model or checkpoint through the same env code as training.

Submitted like a training job (``job.kind: infer``, what ``otray infer`` does), it is leased
a placement group by the ResourceManager, queues behind other jobs, shows in ``otray jobs``
and the dashboard, can be cancelled, and its rows are kept in the registry
(:func:`run_job`).

``otray infer CONFIG [--checkpoint REF] [--split eval] [--limit N] [--out FILE]`` runs every
env of the config over a dataset split with the agent loop (one episode per task), or,
for a game config, the coordinator's evaluation games (each role against each of
``game.eval_opponents``). It writes one JSON line per episode or game (prompt, messages,
response, reward, turns, env info, error) and returns summary metrics per env. The
rollout workers come from ``rollout.num_workers`` and ``resources`` as in training; no
learner is created.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otray import metric_keys as K
from otray.actors.job.env_source import EnvRollouts
from otray.actors.job.episodes import episode_metrics, load_splits, logged_images
from otray.actors.job.runtime import ActorFactory
from otray.config import Config, trained_policies
from otray.actors.sampling.fleet import RolloutFleet
from otray.models import load_tokenizer
from otray.types import ConfigError, Trajectory, WorkerInfo


def episode_row(t: Trajectory) -> dict[str, Any]:
    users = [m["content"] for m in t.messages if m["role"] == "user"]
    replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
    return {"task": t.task.id, "env": t.task.env, "agent": t.agent_id, "prompt": users[0] if users else None,
            "messages": t.messages, "response": replies[-1] if replies else None, "reward": t.reward,
            "turn_rewards": t.turn_rewards, "turns": t.num_turns, "finished": t.finished, "truncated": t.truncated,
            "info": {k: v for k, v in t.info.items() if isinstance(v, (int, float, str, bool, type(None)))},
            "error": None if t.error is None else {"kind": t.error.kind, "message": t.error.message},
            **logged_images(t)}


class InferenceJob:
    """Rollout workers serving one model, and the env rollouts (or the game's evaluation games) over them;
    no learner. Bundle 0 holds the job driver (and a game's coordinator), workers take bundles 1..N."""

    def __init__(self, cfg: Config, model_path: str, *, placement_group: Any = None, job_dir: str | Path = "."):
        import ray

        from otray.actors.sampling.rollout import wait_ready

        if cfg.game is not None and len(trained_policies(cfg)) > 1:
            raise ConfigError("otray infer plays one model: give a game config with one trained policy")
        self.cfg, self.dir = cfg, Path(job_dir)
        tokenizer = load_tokenizer(model_path)
        self.factory = factory = ActorFactory(cfg, model_path, placement_group, job_id=self.dir.name)
        workers = factory.workers(1, cfg.rollout.num_workers)
        wait_ready(workers)
        self.fleet = RolloutFleet(workers)
        info: WorkerInfo = ray.get(workers[0].info.remote())
        self.rollouts = EnvRollouts(cfg, tokenizer, self.fleet.generate, info.max_model_len)
        self.games = None
        if cfg.game is not None:
            from otray.actors.job.game_source import GameGroupSource

            self.games = GameGroupSource(cfg, factory, tokenizer, info.max_model_len, {"main": tuple(workers)}, self.dir)

    def run(self, split: str, out: Path, *, limit: int | None = None, greedy: bool | None = None) -> dict[str, Any]:
        greedy = self.cfg.eval.greedy if greedy is None else greedy
        t0 = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)
        summary: dict[str, Any] = {}
        with out.open("w") as f:
            if self.games is not None:
                for _, spec, role, results in self.games.eval_games(greedy, limit):
                    opponent = str(spec)
                    for r in results:
                        f.write(json.dumps({"seed": r.seed, "seating": r.seating, "role": role, "opponent": opponent,
                                            "rewards": r.rewards, "moves": r.moves, "counts": r.counts,
                                            "phases": r.phases, "error": None if r.error is None else r.error.message,
                                            "episodes": [episode_row(t) for a in r.seating
                                                         for t in r.agent_trajectories(a)]}) + "\n")
                    done = [r for r in results if r.error is None]
                    if done:
                        summary[f"{role}_vs_{opponent}/win_rate"] = statistics.fmean(r.rewards[role] > 0 for r in done)
                        summary[f"{role}_vs_{opponent}/games"] = len(done)
            else:
                for name, env in self.cfg.envs.items():
                    sources = load_splits(name, env.dataset, env.splits, self.cfg.job.seed, f"envs.{name}")
                    if split not in sources:
                        raise ConfigError(f"envs.{name} has no {split!r} split (it has: {', '.join(sources)}); "
                                          f"pick one with --split")
                    tasks = sources[split].tasks[:limit]
                    trajs = [t for g in self.rollouts.rollout(tasks, 0, n=1, greedy=greedy) for t in g.trajectories]
                    f.writelines(json.dumps(episode_row(t)) + "\n" for t in trajs)
                    summary.update(episode_metrics(trajs, f"{name}/"))
                    summary[f"{name}/episodes"] = len(trajs)
        generate_s = self.rollouts.generate_s + (self.games.generate_s if self.games is not None else 0.0)
        summary.update({"output": str(out), "seconds": time.perf_counter() - t0, "generate_s": generate_s})
        return summary


def model_for(cfg: Config, job_dir: str | Path) -> str:
    """The model an inference job runs: ``infer.checkpoint`` (a registered checkpoint the job driver
    fetched, a checkpoint directory or a model directory), else ``model.path``."""
    from otray.checkpoints import frozen_model_dir
    from otray.models import resolve_model_path

    if cfg.infer.checkpoint:
        return frozen_model_dir(cfg.infer.checkpoint, job_dir)
    return resolve_model_path(cfg.model.path, cfg.model.cache_dir)


def viewer_row(row: dict[str, Any]) -> dict[str, Any]:
    """An output episode in the shape of the episodes training jobs log (the dashboard's trajectory viewer)."""
    error = row.get("error")
    return {"step": 1, "task": row["task"], "env": row["env"], "agent": row.get("agent"), "messages": row["messages"],
            "turn_rewards": row["turn_rewards"], "reward": row["reward"], "advantage": None,
            "finished": row["finished"], "truncated": row["truncated"], "info": row["info"],
            "error": None if error is None else f"{error['kind']}: {error['message']}",
            **{k: row[k] for k in ("images", "images_omitted") if k in row}}


def run_job(cfg: Config, job_dir: str | Path, *, placement_group: Any = None,
            report: Callable[[dict[str, Any]], Any] | None = None,
            on_episodes: Callable[[list[dict[str, Any]]], Any] | None = None,
            on_outputs: Callable[[list[dict[str, Any]]], Any] | None = None, chunk: int = 500) -> dict[str, Any]:
    """An inference job (``job.kind: infer``) in its placement group: run, write
    ``<job dir>/inference.jsonl`` (or ``infer.out``), hand the rows to ``on_outputs`` (the
    ResourceManager keeps them for ``otray infer`` to download from any node), log the first
    episodes for the dashboard's viewer and report one metrics row with the summary."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_for(cfg, job_dir)
    job = InferenceJob(cfg, model_path, placement_group=placement_group, job_dir=job_dir)
    out = Path(cfg.infer.out) if cfg.infer.out else job_dir / "inference.jsonl"
    try:
        summary = job.run(cfg.infer.split, out, limit=cfg.infer.limit, greedy=cfg.infer.greedy)
    finally:
        job.factory.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    if on_outputs is not None:
        for start in range(0, len(rows), chunk):
            on_outputs(rows[start:start + chunk])
    if on_episodes is not None and cfg.game is None and rows:
        on_episodes([viewer_row(r) for r in rows[:50]])
    row = {K.STEP: 1, K.PHASE: K.PHASE_INFER, "model": model_path, "rows": len(rows),
           **{k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}
    with (job_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    if report is not None:
        report(row)
    summary = {"model": model_path, **summary}
    (job_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
