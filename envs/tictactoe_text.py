"""Text side of PettingZoo's own ``tictactoe_v3`` (used unmodified through the TextBridge).

PettingZoo numbers the squares column by column (0 1 2 down the left column, 3 4 5
the middle, 6 7 8 the right) and its observation planes are indexed
``[column, row]``. The renderer draws the board in rows, shows the agent's own
marks as X and the opponent's as O whichever side it plays, and writes each empty
square's action number in it; a move is ``<move>4</move>``.
"""

from __future__ import annotations

from typing import Any

from otray.coordinator.text_bridge import GameText, generic_parse


def render_text(observation: dict[str, Any], agent: str) -> str:
    planes = observation["observation"]
    rows = []
    for r in range(3):
        cells = []
        for c in range(3):
            cells.append("X" if planes[c, r, 0] else "O" if planes[c, r, 1] else str(c * 3 + r))
        rows.append(" | ".join(cells))
    return "\n".join(rows) + "\nYou are X. Reply with the number of an empty square as <move>4</move>."


TEXT = GameText(render=render_text, parse=generic_parse)
