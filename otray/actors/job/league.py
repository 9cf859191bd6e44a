"""League play in a game job: pools of past snapshots, the workers that play them, who meets whom.

:class:`League` owns one :class:`~otray.algos.league.LeaguePool` per trained policy and one rollout
worker per pool. Each step (:meth:`League.draw`) it draws a snapshot from every pool and, when the
drawn snapshot is not already there, loads its weights (read from the checkpoint's model directory)
into that pool's worker. :meth:`League.seatings` turns a seed's configured seating into league
seatings: each trained agent in turn keeps its seat; every other trained seat gets a league opponent
for the policy that sits there, drawn per seed (so a GRPO group meets one opponent): a fixed opponent
with ``fixed_share``, else the pool's snapshot of this step, else (empty pool) the current policy.
:meth:`League.record` credits each game to the pool it was played against (the PFSP statistics) and
to the job's Elo table, where every snapshot is a player (``<policy>-step-<N>``).
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

from otray.algos.league import LeaguePool, Snapshot
from otray.algos.ratings import EloTable, game_score
from otray.config import LeagueSection
from otray.actors.rollout.protocol import GameResult, Policy
from otray.policies import PolicySpec
from otray.types import SamplingParams, WeightUpdate

LEAGUE = "league:"  # policy-library names of the pool workers: league:<trained policy>


def snapshot_update(model_dir: str | Path, version: int) -> WeightUpdate:
    """A checkpoint's exported model as a weight update for a rollout worker: a LoRA adapter, or the full
    weights (a tied head written out again: vLLM reloads it in place)."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    if (d / "adapter_config.json").exists():
        return WeightUpdate(version, "lora", load_file(d / "adapter_model.safetensors"),
                            json.loads((d / "adapter_config.json").read_text()))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"league snapshot {d} holds no *.safetensors weights: was its checkpoint removed?")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(f))
    config = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    if "lm_head.weight" not in tensors and config.get("tie_word_embeddings") and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return WeightUpdate(version, "full", tensors)


class League:
    def __init__(self, section: LeagueSection, trained: list[str], workers: dict[str, tuple[Any, ...]], job_seed: int):
        self.section, self.trained, self.workers, self.job_seed = section, trained, workers, job_seed
        self.pools = {name: LeaguePool(section.max_size, section.priority) for name in trained}
        self.fixed = [PolicySpec.parse(p, "game.league.fixed") for p in section.fixed]
        self.drawn: dict[str, Snapshot | None] = {name: None for name in trained}
        self.loaded: dict[str, int | None] = {name: None for name in trained}  # the snapshot step in each worker

    def library(self, params: SamplingParams) -> dict[str, Policy]:
        """The pool workers as model policies of the coordinator's library."""
        return {LEAGUE + n: Policy("model", name=LEAGUE + n, workers=w, params=params) for n, w in self.workers.items()}

    def due(self, step: int) -> bool:
        return step > 0 and step % self.section.every == 0

    def add(self, step: int, checkpoint: str | Path, elo: EloTable) -> None:
        """Every trained policy's model in the checkpoint at ``step`` joins its pool (and the Elo table at the
        policy's current rating)."""
        for k, name in enumerate(self.trained):
            model_dir = Path(checkpoint) / ("model" if k == 0 else f"policies/{name}/model")
            self.pools[name].add(step, str(model_dir))
            elo.ratings.setdefault(self.player(name, step), elo.rating(name))

    @staticmethod
    def player(name: str, step: int) -> str:
        return f"{name}-step-{step}"

    def draw(self, step: int) -> None:
        """This step's snapshot of every pool, its weights loaded into the pool's worker if not there yet."""
        import ray

        rng = random.Random(self.job_seed * 1_000_003 + step)
        for name, pool in self.pools.items():
            snap = self.drawn[name] = pool.sample(rng)
            if snap is not None and self.loaded[name] != snap.step:
                update = ray.put(snapshot_update(snap.model_dir, snap.step))
                ray.get([w.update_weights.remote(update) for w in self.workers[name]])
                self.loaded[name] = snap.step

    def seatings(self, base: dict[str, PolicySpec], seed: int, step: int) -> list[dict[str, str]]:
        """League seatings of one seed: per trained agent of ``base``, that agent keeps its policy and every
        other trained seat gets a league opponent; other seats stay as configured."""
        rng = random.Random((self.job_seed * 1_000_003 + step) * 7919 + seed)
        out = []
        for agent, spec in base.items():
            if spec.kind == "trained":
                out.append({a: (str(s) if a == agent or s.kind != "trained" else self._opponent(s.arg, rng))
                            for a, s in base.items()})
        return out

    def _opponent(self, name: str, rng: random.Random) -> str:
        if self.fixed and (rng.random() < self.section.fixed_share or self.drawn[name] is None):
            return str(rng.choice(self.fixed))
        return LEAGUE + name if self.drawn[name] is not None else f"trained:{name}"

    def record(self, results: list[GameResult], elo: EloTable) -> dict[str, float]:
        """Credit the step's league games (finished ones) to the pools and the Elo table; the league metrics:
        games played, and per pool its size, the snapshot drawn and the current policy's score against it."""
        scores: dict[str, list[float]] = {}
        for r in (r for r in results if r.error is None):
            for pool in (p[len(LEAGUE):] for p in r.seating.values() if p.startswith(LEAGUE)):
                snapshot = self.player(pool, self.drawn[pool].step)
                for learner, policy in r.seating.items():
                    if policy.startswith("trained:"):
                        score = game_score(r.rewards[learner])
                        scores.setdefault(pool, []).append(score)
                        elo.record(policy.split(":", 1)[1], snapshot, score)
        out: dict[str, float] = {"league/games": len(results)}
        for name, pool in self.pools.items():
            prefix = "league/" if len(self.pools) == 1 else f"league/{name}/"
            out[prefix + "pool_size"] = len(pool.snapshots)
            drawn = self.drawn[name]
            if drawn is not None:
                pool.record(drawn.step, scores.get(name, []))
                out[prefix + "snapshot_step"] = drawn.step
            if scores.get(name):
                out[prefix + "games_vs_snapshot"] = len(scores[name])
                out[prefix + "score_vs_snapshot"] = statistics.fmean(scores[name])
        return out

    def state(self) -> dict[str, Any]:
        return {name: pool.state() for name, pool in self.pools.items()}

    def load_state(self, state: dict[str, Any]) -> None:
        for name, pool_state in state.items():
            if name in self.pools:
                self.pools[name] = LeaguePool.from_state(pool_state)
