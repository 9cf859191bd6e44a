"""ProtocolCoordinator overhead.

1. Scripted policies: games/s through the coordinator vs. a plain PettingZoo loop
   (``agent_iter`` / ``last`` / ``step``) in the same process, on the same seeds, with
   the same move choices (the coordinator's seeded random policy and the scripted
   heuristic), for tic-tac-toe and 7x7 Gomoku. The move lists are compared, so both
   sides do the same games. Ratio = coordinator / plain (1.0 = no overhead).
2. The tiny model at G=64 games per run: the share of the coordinator's phase time spent
   outside generate calls (rendering, tokenizing, parsing, env steps), target <= 5%,
   (a) with an HF RolloutWorker in this process and (b) as in a job: the coordinator and
   the worker as Ray actors.

Prints a table and saves ``benchmarks/results/coordinator.json``.

    python benchmarks/coordinator.py [--games 200] [--repeats 3] [--model-games 64] [--model-repeats 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
RESULTS = Path(__file__).resolve().parent / "results"


def plain_loop(make_env, policies: dict, seeds: list[int]) -> list[list[tuple[str, int]]]:
    """The reference: PettingZoo's own AEC loop, one game after another, no text."""
    from otray.games import legal_actions

    games = []
    for seed in seeds:
        env, moves = make_env(), []
        env.reset(seed=seed)
        for agent in env.agent_iter():
            obs, _, term, trunc, _ = env.last()
            if term or trunc:
                env.step(None)
                continue
            fn = policies[agent]
            action = (random.Random(seed * 7919 + len(moves)).choice(legal_actions(obs)) if fn == "random"
                      else int(fn(obs, agent)))
            moves.append((agent, action))
            env.step(action)
        games.append(moves)
    return games


def scripted_comparison(name: str, make_env, seats: dict, games: int, repeats: int) -> dict:
    from otray.actors.rollout.protocol import Policy, ProtocolCoordinator
    from otray.games import GameText

    seeds = list(range(games))
    policies = {a: Policy("random") if fn == "random" else Policy("scripted", fn=fn) for a, fn in seats.items()}
    coord = ProtocolCoordinator(make_env, GameText(), policies)
    plain_s, coord_s = [], []
    for _ in range(repeats):  # alternate, so machine noise hits both
        t0 = time.perf_counter()
        plain = plain_loop(make_env, seats, seeds)
        plain_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        results = coord.run(seeds)
        coord_s.append(time.perf_counter() - t0)
    same = [r.moves for r in results] == plain
    row = {"game": name, "games": games, "same_moves": same,
           "plain_games_per_s": games / statistics.median(plain_s),
           "coordinator_games_per_s": games / statistics.median(coord_s)}
    row["ratio"] = row["coordinator_games_per_s"] / row["plain_games_per_s"]
    return row


def model_share(tiny: str, games: int, actors: bool, repeats: int) -> dict:
    """G games of tic-tac-toe, the tiny model (player_1) vs random, ``repeats`` coordinator runs (new seeds each);
    the time outside generate over all of them (one run's share moves by +-1.5 points from run to run here)."""
    from pettingzoo.classic import tictactoe_v3

    from envs.tictactoe_text import TEXT
    from otray.actors.sampling.rollout import RolloutWorker
    from otray.actors.rollout.agent_loop import Limits
    from otray.actors.rollout.protocol import Policy, ProtocolCoordinator
    from otray.actors.rollout.text_bridge import MoveRules
    from otray.models import load_tokenizer
    from otray.types import SamplingParams

    tok = load_tokenizer(tiny)
    kwargs = dict(rules=MoveRules(max_retries=0), limits=Limits(max_turns=100, max_tokens_per_turn=6,
                                                                  max_tokens_per_episode=40, max_model_len=512))
    params = SamplingParams(max_tokens=6, temperature=1.0)
    if actors:
        import ray

        from otray.actors.sampling.fleet import RolloutFleet

        worker = ray.remote(num_cpus=1)(RolloutWorker).options(
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "2"}}).remote(tiny, "hf", max_model_len=512, num_threads=2)
        policies = {"player_1": Policy("model", generate=RolloutFleet([worker]).generate, params=params),
                    "player_2": Policy("random")}
        coord = ray.remote(num_cpus=0)(ProtocolCoordinator).remote(tictactoe_v3.env, TEXT, policies, tok, **kwargs)
        ray.get(coord.play.remote(range(8)))  # warm-up
        runs = [ray.get(coord.play.remote(list(range(k * games, (k + 1) * games)))) for k in range(repeats)]
    else:
        worker = RolloutWorker(tiny, "hf", max_model_len=512, num_threads=2)
        policies = {"player_1": Policy("model", generate=worker.generate, params=params),
                    "player_2": Policy("random")}
        coord = ProtocolCoordinator(tictactoe_v3.env, TEXT, policies, tok, **kwargs)
        coord.play(range(8))  # warm-up
        runs = [coord.play(list(range(k * games, (k + 1) * games))) for k in range(repeats)]
    phase_s, generate_s = sum(p.elapsed_s for p in runs), sum(p.generate_s for p in runs)
    return {"setup": "Ray actors (as in a job)" if actors else "in-process", "games": games, "repeats": repeats,
            "phase_s": phase_s, "generate_s": generate_s, "generate_calls": sum(p.generate_calls for p in runs),
            "share_outside_generate": (phase_s - generate_s) / phase_s,
            "share_per_run": [p.share_outside_generate for p in runs],
            "errored": sum(r.error is not None for p in runs for r in p.results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-games", type=int, default=64)
    ap.add_argument("--model-repeats", type=int, default=8)
    args = ap.parse_args()

    from pettingzoo.classic import tictactoe_v3

    from envs import gomoku, tictactoe_text
    from otray.models import resolve_model_path

    scripted = [
        scripted_comparison("tictactoe random vs random", tictactoe_v3.env,
                            {"player_1": "random", "player_2": "random"}, args.games, args.repeats),
        scripted_comparison("tictactoe heuristic vs random", tictactoe_v3.env,
                            {"player_1": tictactoe_text.heuristic, "player_2": "random"}, args.games, args.repeats),
        scripted_comparison("gomoku 7x7 heuristic vs random", lambda: gomoku.env(size=7, win_length=4),
                            {"black": gomoku.heuristic, "white": "random"}, args.games // 4, args.repeats),
    ]
    print(f"{'scripted game':34} {'plain g/s':>10} {'coord g/s':>10} {'ratio':>6}  same moves")
    for r in scripted:
        print(f"{r['game']:34} {r['plain_games_per_s']:10.1f} {r['coordinator_games_per_s']:10.1f} "
              f"{r['ratio']:6.2f}  {r['same_moves']}")

    import ray

    tiny = resolve_model_path("tiny")
    model = [model_share(tiny, args.model_games, actors=False, repeats=args.model_repeats)]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        model.append(model_share(tiny, args.model_games, actors=True, repeats=args.model_repeats))
    finally:
        ray.shutdown()
    print(f"\n{'tiny model, G=' + str(args.model_games):26} {'phase s':>8} {'generate s':>10} {'calls':>6} {'outside':>8}")
    for r in model:
        print(f"{r['setup']:26} {r['phase_s']:8.2f} {r['generate_s']:10.2f} {r['generate_calls']:6d} "
              f"{r['share_outside_generate']:8.1%}")
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args),
           "scripted": scripted, "model": model, "target_share_outside_generate": 0.05}
    (RESULTS / "coordinator.json").write_text(json.dumps(out, indent=1))
    print(f"\nsaved {RESULTS / 'coordinator.json'}")


if __name__ == "__main__":
    main()
