"""Gymnasium's FrozenLake as a text env, through :class:`otray.gym_env.GymnasiumEnv`.

It shows the adapter on an env whose spaces are not text: ``obs_to_text`` turns
the cell index into words, ``text_to_action`` reads one of left/down/right/up.
Config: ``entry: gymnasium`` with ``kwargs: {env: FrozenLake-v1, make_kwargs:
{is_slippery: false}, obs_to_text: envs.frozen_lake:obs_to_text, text_to_action:
envs.frozen_lake:text_to_action}``.
"""

from __future__ import annotations

import re
from typing import Any

MOVES = ("left", "down", "right", "up")  # FrozenLake's action ids 0..3


def obs_to_text(obs: Any, info: dict[str, Any]) -> str:
    row, col = divmod(int(obs), 4)
    return f"You are at row {row}, column {col} of a 4x4 lake; the goal is row 3, column 3. Move: left, down, right or up."


def text_to_action(text: str) -> int:
    words = re.findall(r"left|down|right|up", text.lower())
    if not words:
        raise ValueError("answer with one of: left, down, right, up")
    return MOVES.index(words[-1])
