"""Does a Gomoku policy block? ``python benchmarks/gomoku_blocks.py --model LABEL=DIR [...] [--games 200]``.

Plays white against OpenTinker's opponent as black (the longest-line heuristic with 30% random moves, the
eval opponent of ``conf/gomoku_opentinker.yaml``) on the same 4x4 / three-in-a-row board and the same fixed
eval seeds as a job's evaluation, for each model directory given (a checkpoint's ``model/``, sampled at
temperature 1 with the job's move rule: an unreadable or taken cell is replaced by a random one) and for
scripted white players beside them (random; the heuristic with 60%, 30% and 0% random moves), and each
model and random as black too. At every move of the player's it reads the board: where the opponent
threatens to complete a line next move at exactly one cell and the player cannot win at once, a move on
that cell is a *block*; where the player can win at once, taking a winning cell is a *win taken*.
Prints and saves ``benchmarks/results/gomoku_blocks.json``.

Why: white's win rate in the Gomoku experiment rises a few points and stops (docs/notes/learning.md); this
says whether the trained policy learned to block at all, against what the scripted players do.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from envs import gomoku  # noqa: E402
from otray import config  # noqa: E402
from otray.actors.rollout.agent_loop import Limits  # noqa: E402
from otray.actors.rollout.protocol import GameResult, Policy, ProtocolCoordinator  # noqa: E402
from otray.actors.rollout.text_bridge import MoveRules  # noqa: E402
from otray.types import SamplingParams  # noqa: E402

GAME = config.load(ROOT / "conf" / "gomoku_opentinker.yaml").game  # the board, limits and move rule of the experiment
SIZE, LINE = GAME.kwargs["size"], GAME.kwargs["win_length"]
EVAL_SEEDS = 10**9  # the first of a job's fixed eval seeds (otray/actors/job/game_source.py)


def seat_moves(game: GameResult, seat: str) -> tuple[int, int, int, int]:
    """Replays ``game``: (single threats ``seat`` faced, blocked, wins it could take, taken)."""
    env = gomoku.env(size=SIZE, win_length=LINE)
    env.reset(seed=game.seed)
    threats = blocks = chances = taken = 0
    for agent, action in game.moves:
        if agent == seat:
            mine, theirs = gomoku.threats(env.observe(seat), LINE)
            if mine:
                chances, taken = chances + 1, taken + (action in mine)
            elif len(theirs) == 1:
                threats, blocks = threats + 1, blocks + (action == theirs[0])
        env.step(action)
    return threats, blocks, chances, taken


def summary(games: list[GameResult], seat: str) -> dict[str, float]:
    counts = [seat_moves(g, seat) for g in games]
    threats, blocks, chances, taken = (sum(c[i] for c in counts) for i in range(4))
    return {"games": len(games), "win_rate": sum(g.rewards[seat] > 0 for g in games) / len(games),
            "illegal_per_game": sum(g.counts[seat]["illegal"] for g in games) / len(games),
            "threats_per_game": threats / len(games), "block_rate": blocks / max(threats, 1),
            "win_chances_per_game": chances / len(games), "wins_taken_rate": taken / max(chances, 1)}


def play(player: Policy, games: int, tokenizer=None, seat: str = "white") -> dict[str, float]:
    """``player`` in ``seat`` against OpenTinker's opponent in the other, ``games`` eval seeds."""
    opponent = Policy("scripted", name="heuristic", fn=functools.partial(gomoku.heuristic, random_prob=0.3))
    seats = {"black": player, "white": opponent} if seat == "black" else {"black": opponent, "white": player}
    coord = ProtocolCoordinator(functools.partial(gomoku.env, size=SIZE, win_length=LINE), gomoku.text(SIZE),
                                seats, tokenizer, rules=MoveRules(GAME.max_retries, GAME.on_exhausted),
                                limits=Limits(max_turns=GAME.max_turns, max_tokens_per_turn=GAME.max_tokens_per_turn,
                                              max_tokens_per_episode=GAME.max_tokens_per_episode, max_model_len=512),
                                context=GAME.context)
    return summary(coord.run(range(EVAL_SEEDS, EVAL_SEEDS + games)), seat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="LABEL=DIR of a model directory (repeatable)")
    ap.add_argument("--games", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gomoku_blocks.json"))
    args = ap.parse_args()
    rows = {}
    for p in (1.0, 0.6, 0.3, 0.0):
        fn = functools.partial(gomoku.heuristic, random_prob=p)
        rows[f"heuristic p={p}" if p < 1 else "random"] = play(Policy("scripted", fn=fn), args.games)
    rows["random as black"] = play(Policy("random"), args.games, seat="black")
    for spec in args.model:
        from transformers import AutoTokenizer

        from otray.actors.sampling.rollout import RolloutWorker

        label, path = spec.split("=", 1)
        worker = RolloutWorker(path, "hf", max_model_len=512, seed=0)
        model = Policy("model", name=label, generate=worker.generate,
                       params=SamplingParams(max_tokens=GAME.max_tokens_per_turn, temperature=GAME.temperature))
        tokenizer = AutoTokenizer.from_pretrained(path)
        rows[label] = play(model, args.games, tokenizer)
        rows[f"{label} as black"] = play(model, args.games, tokenizer, seat="black")
    for label, r in rows.items():
        print(f"{label:>24}: win {r['win_rate']:.3f}  blocks {r['block_rate']:.3f} of {r['threats_per_game']:.2f} "
              f"threats/game  wins taken {r['wins_taken_rate']:.3f} of {r['win_chances_per_game']:.2f}/game  "
              f"illegal/game {r['illegal_per_game']:.2f}")
    Path(args.out).write_text(json.dumps({"opponent": "heuristic(random_prob=0.3) in the other seat",
                                          "board": [SIZE, LINE], "models": args.model, "white unless named": rows},
                                         indent=1))
    print("saved", args.out)


if __name__ == "__main__":
    main()
