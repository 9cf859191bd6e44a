"""Training on a multi-agent game (config section ``game``): the RL step of ARCHITECTURE.md
with the ProtocolCoordinator in place of the single-agent loop.

One step: ``algo.batch_size`` fresh game seeds, each played ``game.num_rollouts`` times
(so every (seed, role) of a trained agent is a GRPO group) -> each trained agent's
trajectory gets its PettingZoo reward -> advantages grouped by (seed, role) -> learn ->
push weights. Evaluation: the trained policy against ``game.eval_opponent`` in every role,
win / draw / loss rates per role.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from otray.algos import advantages as adv
from otray.algos.datums import build_datums
from otray.config import import_object
from otray.coordinator.agent_loop import Limits
from otray.coordinator.protocol import GameResult, Policy, ProtocolCoordinator
from otray.coordinator.text_bridge import MoveRules
from otray.types import SamplingParams


class GameTrainer:
    def __init__(self, job: Any):
        self.job, self.game = job, job.cfg.game
        self.make_env = functools.partial(import_object(self.game.entry), **self.game.kwargs)
        self.text = import_object(self.game.text)
        self.roles = list(self.make_env().possible_agents)
        unknown = set(self.game.policies) ^ set(self.roles)
        if unknown:
            from otray.types import ConfigError

            raise ConfigError(f"game.policies must name exactly the game's agents {self.roles}; "
                              f"got {sorted(self.game.policies)}")
        self.next_seed = job.cfg.job.seed * 1_000_003  # the data position: seeds are used once

    def _policies(self, specs: dict[str, str], greedy: bool) -> dict[str, Policy]:
        g = self.game
        trained = Policy("model", name="trained", generate=self.job.fleet.generate,
                         params=SamplingParams(max_tokens=g.max_tokens_per_turn,
                                               temperature=0.0 if greedy else g.temperature))
        out = {}
        for agent, spec in specs.items():
            if spec == "trained":
                out[agent] = trained  # one object: self-play agents share one batched call
            elif spec == "random":
                out[agent] = Policy("random")
            else:
                out[agent] = Policy("scripted", name=spec, fn=import_object(spec.split(":", 1)[1]))
        return out

    def play(self, specs: dict[str, str], seeds: list[int], greedy: bool = False) -> tuple[list[GameResult], float]:
        g = self.game
        coord = ProtocolCoordinator(self.make_env, self.text, self._policies(specs, greedy), self.job.tokenizer,
                                    rules=MoveRules(g.max_retries, g.on_exhausted),
                                    limits=Limits(max_turns=10_000, max_tokens_per_turn=g.max_tokens_per_turn,
                                                  max_tokens_per_episode=g.max_tokens_per_episode,
                                                  max_model_len=self.job.worker_info["max_model_len"]),
                                    env_name=g.entry)
        t0 = time.perf_counter()
        results = coord.run(seeds)
        elapsed = time.perf_counter() - t0
        self.job.generate_s += coord.generate_s
        return results, (elapsed - coord.generate_s) / max(elapsed, 1e-9)

    def step(self) -> dict[str, Any]:
        job, algo, t0 = self.job, self.job.cfg.algo, time.perf_counter()
        seeds = [self.next_seed + i for i in range(algo.batch_size)]                    # 1. game seeds
        self.next_seed += algo.batch_size
        results, outside = self.play(self.game.policies,                                # 2-3. games, rewards
                                     [s for s in seeds for _ in range(self.game.num_rollouts)])
        t_gen = time.perf_counter() - t0
        trajs = [t for r in results if r.error is None for t in r.trajectories.values()]
        keys = [(t.info["game_seed"], t.info["role"]) for t in trajs]
        advantages = adv.grouped(algo.advantage, [t.reward for t in trajs], keys)         # 4-5. (seed, role) groups
        learned = job.learn(build_datums(trajs, advantages))                            # 6-7. learn, push weights
        job.step += 1
        metrics = {"step": job.step, "batch": f"seeds {seeds[0]}-{seeds[-1]}",
                   "reward_mean": statistics.fmean(t.reward for t in trajs) if trajs else 0.0,
                   "games": len(results), "games_errored": sum(r.error is not None for r in results),
                   "phase_share_outside_generate": outside,
                   "tokens_per_s": sum(t.num_sampled for t in trajs) / max(t_gen, 1e-9), "rollout_s": t_gen,
                   "step_s": time.perf_counter() - t0, **learned}
        for role in self.roles:
            mine = [r for r in results if r.error is None and self.game.policies[role] == "trained"]
            if mine:
                metrics[f"{role}/win_rate"] = statistics.fmean(r.rewards[role] > 0 for r in mine)
                metrics[f"{role}/illegal_per_game"] = statistics.fmean(r.counts[role]["illegal"] for r in mine)
        return metrics

    def evaluate(self, greedy: bool) -> dict[str, float]:
        """The trained policy in every role against ``game.eval_opponent``: win/draw/loss rates."""
        out, wins = {}, []
        seeds = list(range(10**9, 10**9 + self.game.eval_games))  # fixed, never used in training
        for role in self.roles:
            specs = {a: ("trained" if a == role else self.game.eval_opponent) for a in self.roles}
            results, _ = self.play(specs, seeds, greedy)
            done = [r for r in results if r.error is None]
            prefix = f"eval/{role}_vs_{self.game.eval_opponent.split(':')[-1]}/"
            if not done:
                continue
            out[prefix + "win_rate"] = statistics.fmean(r.rewards[role] > 0 for r in done)
            out[prefix + "draw_rate"] = statistics.fmean(r.rewards[role] == 0 for r in done)
            out[prefix + "loss_rate"] = statistics.fmean(r.rewards[role] < 0 for r in done)
            out[prefix + "illegal_per_game"] = statistics.fmean(r.counts[role]["illegal"] for r in done)
            wins.append(out[prefix + "win_rate"])
        if wins:
            out["eval/accuracy"] = statistics.fmean(wins)  # the summary's held-out figure: mean win rate
        return out
