"""What an env author needs to put a PettingZoo game in front of an LLM: the game's text.

A :class:`GameText` says how an agent's observation is written for the model
(``render(observation, agent) -> str``) and how its reply is read back
(``parse(reply) -> action | None``), plus a well-formed ``example`` reply (jobs check
that ``game.max_tokens_per_turn`` fits it). The generic fallbacks list the legal
action indices from the observation's ``action_mask`` (the PettingZoo classic-games
convention) and read ``<move>N</move>``. A game config names its text as
``game.text: module:TEXT`` (or a function of ``game.kwargs`` returning one).

This module is public API (``otray.games``) and sits at the env level: it imports
nothing of otray's. The coordinator's bridges (``otray.actors.rollout.text_bridge``) use it.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

_MOVE_INDEX = re.compile(r"<move>\s*(\d+)\s*</move>")
TEXT_VIEW_BYTES = 1 << 14  # the fixed-length byte view of a text observation (UTF-8, zero-padded, cut past it)


class AnyText(spaces.Space):
    """Any Python string of at most ``max_length`` characters (Gymnasium's ``Text`` admits one character set
    only, and a game's text may hold any: board glyphs, accents)."""

    def __init__(self, max_length: int = 1 << 20, seed: int | None = None):
        super().__init__(None, None, seed)
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        alphabet = list(string.printable)
        return "".join(self.np_random.choice(alphabet, int(self.np_random.integers(0, 64))))

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length

    def __repr__(self) -> str:
        return f"AnyText({self.max_length})"


def text_observation_space(max_length: int = 1 << 20) -> spaces.Dict:
    """The observation space of a game whose observations are text: ``{"observation": the text's bytes as a
    fixed-length uint8 array (what PettingZoo's ``api_test`` compares), "text": the text itself}``."""
    return spaces.Dict({"observation": spaces.Box(0, 255, (TEXT_VIEW_BYTES,), np.uint8), "text": AnyText(max_length)})


def text_observation(text: str) -> dict[str, Any]:
    """``text`` as an observation of :func:`text_observation_space`; the model reads ``["text"]`` whole."""
    data = text.encode("utf-8")[:TEXT_VIEW_BYTES]
    view = np.zeros(TEXT_VIEW_BYTES, dtype=np.uint8)
    view[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return {"observation": view, "text": text}


def observation_text(observation: Any) -> str:
    """The text of a text observation (:func:`text_observation`), or ``observation`` itself if it is a string."""
    return observation["text"] if isinstance(observation, dict) and "text" in observation else str(observation)


def legal_actions(observation: Any) -> list[int]:
    """Indices the action mask allows (every action when there is no mask)."""
    mask = observation.get("action_mask") if isinstance(observation, dict) else None
    return [] if mask is None else [int(i) for i in np.flatnonzero(mask)]


def generic_render(observation: Any, agent: str) -> str:
    """Fallback renderer: the raw observation and the legal action indices."""
    obs = observation.get("observation") if isinstance(observation, dict) else observation
    legal = legal_actions(observation)
    return (f"You are {agent}. Observation: {np.asarray(obs).tolist()}\n"
            f"Legal moves: {', '.join(map(str, legal))}. Reply with one as <move>N</move>.")


def generic_parse(text: str) -> int | None:
    found = _MOVE_INDEX.findall(text)
    return int(found[-1]) if found else None


@dataclass
class GameText:
    """The per-game text functions: ``render(observation, agent) -> str``, ``parse(reply) -> action | None``."""

    render: Callable[[Any, str], str] = generic_render
    parse: Callable[[str], int | None] = generic_parse
    example: str = "<move>0</move>"  # a well-formed reply: jobs check that max_tokens_per_turn fits it


def decision_dataset(out_dir: str | Path, tag: str, play: Callable[[random.Random], Iterable[tuple[str, str]]], *,
                     seed: int = 0, num_train: int = 2000, num_eval: int = 100) -> dict[str, Path]:
    """Chat JSONL (``train``/``eval``) of single decisions for a ``context: turn`` SFT warm-up: ``play(rng)``
    plays one game and yields each decision as (what the player saw, its reply); rows are drawn at random
    from as many games as it takes. Files are named by ``tag``, ``seed`` and size, and built once."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": num_train, "eval": num_eval}
    paths = {split: out / f"chat_{split}-{tag}-seed{seed}-{n}.jsonl" for split, n in sizes.items()}
    if all(path.exists() for path in paths.values()):
        return paths
    rng = random.Random(seed)
    for split, n in sizes.items():
        rows: list[dict[str, Any]] = []
        while len(rows) < n:
            for seen, reply in play(rng):
                rows.append({"id": f"{tag}-{split}-{len(rows)}", "messages": [
                    {"role": "user", "content": seen}, {"role": "assistant", "content": reply}]})
        tmp = paths[split].with_name(f".{paths[split].name}.{os.getpid()}.tmp")  # whole or not at all, as
        with tmp.open("w") as f:  # otray.env.atomic_write (this module imports nothing of otray's)
            f.writelines(json.dumps(row) + "\n" for row in rng.sample(rows, n))
        os.replace(tmp, paths[split])
    return paths


__all__ = ["GameText", "decision_dataset", "generic_parse", "generic_render", "legal_actions"]
