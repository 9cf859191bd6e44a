"""Text side of PettingZoo's own ``tictactoe_v3`` (used unmodified through the TextBridge).

PettingZoo numbers the squares column by column (0 1 2 down the left column, 3 4 5
the middle, 6 7 8 the right) and its observation planes are indexed
``[column, row]``. The renderer draws the board in rows, shows the agent's own
marks as X and the opponent's as O whichever side it plays, and writes each empty
square's action number in it; a move is ``<move>4</move>``.

Also here: :func:`heuristic`, a scripted opponent (win, else block, else centre,
else a corner, else any square) and :func:`make_chat_dataset`, format demonstrations
(random legal moves in the exact multi-turn text the coordinator produces) for an SFT
warm-up that teaches the reply format and nothing about good play.
"""

from __future__ import annotations

import json
import random
from typing import Any

from otray.games import GameText, generic_parse, legal_actions
from otray.env import atomic_write, dataset_paths

# the eight lines of three, as action numbers (action = column * 3 + row)
LINES = ([[c * 3 + r for r in range(3)] for c in range(3)] + [[c * 3 + r for c in range(3)] for r in range(3)]
         + [[0, 4, 8], [6, 4, 2]])


def render_text(observation: dict[str, Any], agent: str) -> str:
    planes = observation["observation"]
    rows = []
    for r in range(3):
        cells = []
        for c in range(3):
            cells.append("X" if planes[c, r, 0] else "O" if planes[c, r, 1] else str(c * 3 + r))
        rows.append(" | ".join(cells))
    return "\n".join(rows) + "\nYou are X. Reply with the number of an empty square as <move>4</move>."


TEXT = GameText(render=render_text, parse=generic_parse, example="<move>4</move>")


def heuristic(observation: dict[str, Any], agent: str) -> int:
    """A scripted player: complete a line, else block the opponent's, else centre, corner, edge."""
    planes = observation["observation"]
    mine = {a for a in range(9) if planes[a // 3, a % 3, 0]}
    theirs = {a for a in range(9) if planes[a // 3, a % 3, 1]}
    legal = legal_actions(observation)
    for who in (mine, theirs):  # win first, then block
        for line in LINES:
            empty = [a for a in line if a in legal]
            if len(empty) == 1 and sum(a in who for a in line) == 2:
                return empty[0]
    for a in (4, 0, 2, 6, 8, 1, 3, 5, 7):
        if a in legal:
            return a
    raise ValueError("heuristic asked to move on a full board")


def random_dialogue(rng: random.Random) -> list[dict[str, str]]:
    """One game against a random opponent, seen from a random seat that also moves at random."""
    from pettingzoo.classic import tictactoe_v3

    env = tictactoe_v3.env()
    env.reset(seed=rng.randrange(2**31))
    me = rng.choice(env.possible_agents)
    messages: list[dict[str, str]] = []
    for agent in env.agent_iter():
        obs, _, term, trunc, _ = env.last()
        if term or trunc:
            env.step(None)
            continue
        action = rng.choice(legal_actions(obs))
        if agent == me:
            messages += [{"role": "user", "content": render_text(obs, agent)},
                         {"role": "assistant", "content": f"<move>{action}</move>"}]
        env.step(action)
    return messages


def make_chat_dataset(out_dir: str, *, seed: int = 0, num_train: int = 3000, num_eval: int = 100) -> dict[str, Any]:
    """Chat JSONL (train/eval) of :func:`random_dialogue` games, for a format-only SFT warm-up."""
    paths, built = dataset_paths(out_dir, {"train": "chat_train.jsonl", "eval": "chat_eval.jsonl"})
    if built:
        return paths
    rng = random.Random(seed)
    for split, n in (("train", num_train), ("eval", num_eval)):
        with atomic_write(paths[split]) as f:
            for i in range(n):
                f.write(json.dumps({"id": f"ttt-{split}-{i}", "messages": random_dialogue(rng)}) + "\n")
    return paths
