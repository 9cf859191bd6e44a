"""Text side of PettingZoo's own ``connect_four_v3`` (used unmodified through the TextBridge).

The observation is ``(6, 7, 2)``: rows top to bottom, columns left to right, plane 0 the
observing agent's discs, plane 1 the opponent's. The renderer draws the board with the
agent's discs as X and the opponent's as O, numbers the columns 0-6 and lists the
columns that are not full; a move is ``<move>3</move>`` (drop a disc into column 3).
"""

from __future__ import annotations

from typing import Any

from otray.games import GameText, generic_parse, legal_actions


def render_text(observation: dict[str, Any], agent: str) -> str:
    planes = observation["observation"]
    rows = [" ".join("X" if planes[r, c, 0] else "O" if planes[r, c, 1] else "." for c in range(7)) for r in range(6)]
    legal = ", ".join(map(str, legal_actions(observation)))
    return ("\n".join(["0 1 2 3 4 5 6", *rows]) +
            f"\nYou are X. Open columns: {legal}. Reply with a column as <move>3</move>.")


TEXT = GameText(render=render_text, parse=generic_parse, example="<move>3</move>")
