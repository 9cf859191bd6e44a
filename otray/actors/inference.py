"""InferenceJob: batch inference with a model or checkpoint through the same env code as training.

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
from pathlib import Path
from typing import Any

from otray.actors.job import JobActors, episode_metrics, load_splits
from otray.config import Config, trained_policies
from otray.models import load_tokenizer
from otray.types import ConfigError, Trajectory


def episode_row(t: Trajectory) -> dict[str, Any]:
    users = [m["content"] for m in t.messages if m["role"] == "user"]
    replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
    return {"task": t.task.id, "env": t.task.env, "agent": t.agent_id, "prompt": users[0] if users else None,
            "messages": t.messages, "response": replies[-1] if replies else None, "reward": t.reward,
            "turn_rewards": t.turn_rewards, "turns": t.num_turns, "finished": t.finished, "truncated": t.truncated,
            "info": {k: v for k, v in t.info.items() if isinstance(v, (int, float, str, bool, type(None)))},
            "error": None if t.error is None else {"kind": t.error.kind, "message": t.error.message}}


class InferenceJob(JobActors):
    def __init__(self, cfg: Config, model_path: str, *, placement_group: Any = None, job_dir: str | Path = "."):
        import ray

        from otray.actors.rollout import RolloutFleet, wait_ready

        if cfg.game is not None and len(trained_policies(cfg)) > 1:
            raise ConfigError("otray infer plays one model: give a game config with one trained policy")
        self.cfg, self.model_path, self.placement_group = cfg, model_path, placement_group
        self.dir = Path(job_dir)
        self.tokenizer = load_tokenizer(model_path)
        workers = self.make_workers(1, cfg.rollout.num_workers, model_path)
        wait_ready(workers)
        self.fleet = RolloutFleet(workers)
        self.worker_info = ray.get(workers[0].info.remote())
        self.step, self.generate_s, self.first_rollout_at = 0, 0.0, None
        self.learner = None
        self.games = None
        if cfg.game is not None:
            from otray.actors.games import GameTrainer

            self.games = GameTrainer(self)

    def run(self, split: str, out: Path, *, limit: int | None = None, greedy: bool | None = None) -> dict[str, Any]:
        greedy = self.cfg.eval.greedy if greedy is None else greedy
        t0 = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)
        summary: dict[str, Any] = {}
        with out.open("w") as f:
            if self.games is not None:
                for _, opponent, role, results in self.games.eval_games(greedy, limit):
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
                    trajs = [t for g in self.rollout(tasks, n=1, greedy=greedy) for t in g.trajectories]
                    f.writelines(json.dumps(episode_row(t)) + "\n" for t in trajs)
                    summary.update(episode_metrics(trajs, f"{name}/"))
                    summary[f"{name}/episodes"] = len(trajs)
        summary.update({"output": str(out), "seconds": time.perf_counter() - t0, "generate_s": self.generate_s})
        return summary
