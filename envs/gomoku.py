"""Gomoku (five in a row) as a PettingZoo ``AECEnv``, in PettingZoo's classic style.

Two agents, ``black`` (moves first) and ``white``, place stones on a ``size`` x
``size`` board (default 9x9); ``win_length`` in a row (default 5) in any direction
wins. Conventions as in ``pettingzoo.classic``:

- ``env()`` returns the wrapped env (illegal move ends the game with -1 for the
  mover, out-of-bounds asserted, order enforced); ``raw_env`` is the bare class.
- Observations are dicts: ``observation`` of shape ``(size, size, 2)`` (plane 0 =
  the observing agent's stones, plane 1 = the opponent's) and ``action_mask`` over
  the ``size * size`` cells (1 = empty).
- Action ``i`` puts a stone on row ``i // size``, column ``i % size``.
- Rewards: win +1, loss -1, draw (full board) 0.

The text side (what an LLM sees and says) is :func:`render_text` and
:func:`parse_move`: columns are letters, rows numbers from 1, a move is
``<move>E5</move>``.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv
from pettingzoo.utils import AgentSelector, wrappers

from otray.games import GameText, decision_dataset

LETTERS = "ABCDEFGHJKLMNOPQRST"  # no I, as on go boards


def env(**kwargs: Any) -> AECEnv:
    e = raw_env(**kwargs)
    e = wrappers.TerminateIllegalWrapper(e, illegal_reward=-1)
    e = wrappers.AssertOutOfBoundsWrapper(e)
    return wrappers.OrderEnforcingWrapper(e)


class raw_env(AECEnv):  # noqa: N801 - PettingZoo's naming convention
    metadata = {"render_modes": ["ansi"], "name": "gomoku_v0", "is_parallelizable": False}

    def __init__(self, size: int = 9, win_length: int = 5, render_mode: str | None = None):
        super().__init__()
        if not 3 <= size <= len(LETTERS) or not 2 <= win_length <= size:
            raise ValueError(f"gomoku needs 3 <= size <= {len(LETTERS)} and 2 <= win_length <= size, "
                             f"got size={size}, win_length={win_length}")
        self.size, self.win_length, self.render_mode = size, win_length, render_mode
        self.possible_agents = ["black", "white"]
        self.agents = list(self.possible_agents)
        cells = size * size
        self.action_spaces = {a: spaces.Discrete(cells) for a in self.possible_agents}
        self.observation_spaces = {a: spaces.Dict({
            "observation": spaces.Box(0, 1, (size, size, 2), np.int8),
            "action_mask": spaces.Box(0, 1, (cells,), np.int8)}) for a in self.possible_agents}
        self.board = np.zeros((size, size), np.int8)  # 0 empty, 1 black, 2 white

    def observation_space(self, agent: str) -> spaces.Space:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self.action_spaces[agent]

    def observe(self, agent: str) -> dict[str, np.ndarray]:
        me = self.possible_agents.index(agent) + 1
        planes = np.stack([self.board == me, (self.board != me) & (self.board != 0)], axis=-1).astype(np.int8)
        return {"observation": planes, "action_mask": (self.board.reshape(-1) == 0).astype(np.int8)}

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        self.board[:] = 0
        self.agents = list(self.possible_agents)
        self.rewards = {a: 0 for a in self.agents}
        self._cumulative_rewards = {a: 0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {} for a in self.agents}
        self._selector = AgentSelector(self.agents)
        self.agent_selection = self._selector.reset()
        self.moves = 0

    def step(self, action: int) -> None:
        if self.terminations[self.agent_selection] or self.truncations[self.agent_selection]:
            return self._was_dead_step(action)
        agent = self.agent_selection
        row, col = divmod(int(action), self.size)
        if self.board[row, col] != 0:
            raise ValueError(f"cell {move_name(int(action), self.size)} is taken (the action mask forbids it)")
        me = self.possible_agents.index(agent) + 1
        self.board[row, col] = me
        self.moves += 1
        self._cumulative_rewards[agent] = 0
        if self._wins(row, col, me):
            other = self.possible_agents[2 - me]
            self.rewards = {agent: 1, other: -1}
            self.terminations = {a: True for a in self.agents}
        elif self.moves == self.size * self.size:
            self.rewards = {a: 0 for a in self.agents}
            self.terminations = {a: True for a in self.agents}
        self.agent_selection = self._selector.next()
        self._accumulate_rewards()
        if self.render_mode == "ansi":
            print(self.render())

    def _wins(self, row: int, col: int, me: int) -> bool:
        for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
            count = 1
            for sign in (1, -1):
                r, c = row + sign * dr, col + sign * dc
                while 0 <= r < self.size and 0 <= c < self.size and self.board[r, c] == me:
                    count += 1
                    r, c = r + sign * dr, c + sign * dc
            if count >= self.win_length:
                return True
        return False

    def render(self) -> str:
        return render_board(self.board)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- text side


def move_name(action: int, size: int) -> str:
    row, col = divmod(action, size)
    return f"{LETTERS[col]}{row + 1}"


def render_board(board: np.ndarray) -> str:
    """Rows numbered from 1 (top), columns lettered; X = black, O = white, . = empty."""
    size = board.shape[0]
    header = "   " + " ".join(LETTERS[:size])
    rows = [f"{r + 1:>2} " + " ".join(".XO"[v] for v in board[r]) for r in range(size)]
    return "\n".join([header, *rows])


def lines_of(size: int, win_length: int) -> list[list[int]]:
    """Every run of ``win_length`` cells in a row, column or diagonal of a ``size`` board (cell indices)."""
    out = []
    for r in range(size):
        for c in range(size):
            for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                end_r, end_c = r + dr * (win_length - 1), c + dc * (win_length - 1)
                if 0 <= end_r < size and 0 <= end_c < size:
                    out.append([(r + dr * k) * size + c + dc * k for k in range(win_length)])
    return out


def render_lines(board: np.ndarray, win_length: int) -> str:
    """The board's open lines, one a row: its cells' names and what holds them (``A1 B1 C1: X X .``), for
    every line of ``win_length`` with a stone and an empty cell. A line to complete or to block is then a
    local pattern in the text (two of a kind and a dot), not one spread over the board's rows."""
    size, flat = board.shape[0], board.reshape(-1)
    rows = []
    for line in lines_of(size, win_length):
        held = [int(flat[a]) for a in line]
        if any(held) and not all(held):
            rows.append(" ".join(move_name(a, size) for a in line) + ": " + " ".join(".XO"[v] for v in held))
    return "\n".join(rows)


def render_text(observation: dict[str, np.ndarray], agent: str, list_moves: bool = False, win_length: int = 0) -> str:
    """What the agent to move sees: the board from its side (X = its stones) and whose turn it is; with
    ``list_moves`` also the empty cells, as TextArena's games list their available moves; with
    ``win_length`` also the open lines (:func:`render_lines`)."""
    planes = observation["observation"]
    board = planes[..., 0] + 2 * planes[..., 1]
    size = board.shape[0]
    empty = " ".join(move_name(int(a), size) for a in np.flatnonzero(observation["action_mask"]))
    listing = f"\nEmpty cells: {empty}" if list_moves else ""
    lines = f"\nLines:\n{render_lines(board, win_length)}" if win_length else ""
    return f"{render_board(board)}{listing}{lines}\nYou are X. Reply with your move as <move>E5</move>."


_MOVE = re.compile(r"<move>\s*([A-Za-z])\s*(\d{1,2})\s*</move>")


def parse_move(text: str, size: int) -> int | None:
    """``<move>E5</move>`` -> the action index, or None (unparseable or off the board)."""
    found = _MOVE.findall(text)
    if not found:
        return None
    letter, number = found[-1]
    col, row = LETTERS.find(letter.upper()), int(number) - 1
    if not (0 <= col < size and 0 <= row < size):
        return None
    return row * size + col


def text(size: int = 9, **_: Any) -> GameText:
    """The game's ``GameText`` for a board of ``size`` (``game.text: envs.gomoku:text`` passes the kwargs)."""
    return GameText(render=render_text, parse=lambda reply: parse_move(reply, size),
                    example=f"<move>{move_name(size * size - 1, size)}</move>")


def text_listing_moves(size: int = 9, **_: Any) -> GameText:
    """:func:`text` with the empty cells listed under the board (``game.text: envs.gomoku:text_listing_moves``):
    naming a legal cell becomes copying one from the prompt, so a small model's moves are its own choice
    rather than the bridge's random replacement for a taken cell."""
    return dataclasses.replace(text(size), render=lambda obs, agent: render_text(obs, agent, list_moves=True))


def text_with_lines(size: int = 9, win_length: int = 5, **_: Any) -> GameText:
    """:func:`text` with the board's open lines under it (``game.text: envs.gomoku:text_with_lines``; the
    game's ``win_length`` comes from ``game.kwargs``): taking a win or blocking one becomes reading one row
    of text. (It did not help the tiny models imitate the heuristic in 600 SFT steps: docs/notes/learning.md.)"""
    return dataclasses.replace(text(size), render=lambda obs, agent: render_text(obs, agent, win_length=win_length))


def _line_through(stones: np.ndarray, row: int, col: int) -> int:
    """The longest line of ``stones`` through (row, col) if a stone were put there."""
    size, best = stones.shape[0], 1
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        count = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < size and 0 <= c < size and stones[r, c]:
                count += 1
                r, c = r + sign * dr, c + sign * dc
        best = max(best, count)
    return best


def winning_cells(stones: np.ndarray, mask: np.ndarray, win_length: int) -> list[int]:
    """The empty cells (``mask``) where a stone of ``stones`` (one player's plane) would complete a line of
    ``win_length``: that player's immediate threats."""
    size = stones.shape[0]
    return [int(a) for a in np.flatnonzero(mask) if _line_through(stones, *divmod(int(a), size)) >= win_length]


def heuristic(observation: dict[str, np.ndarray], agent: str, random_prob: float = 0.0,
              rng: random.Random | None = None) -> int:
    """A scripted player: the empty cell that makes its longest line, or blocks the opponent's longer one
    (a win beats a block, a block of a win beats anything else), nearer the centre on ties.

    With ``random_prob`` it plays a uniformly random empty cell instead, that often: OpenTinker's Gomoku
    opponent is this player with ``random_prob=0.3`` (``scripted:envs.gomoku:heuristic(random_prob=0.3)``).
    The coordinator passes ``rng`` (seeded by game and move), so its games replay exactly."""
    planes = observation["observation"]
    size, mask = planes.shape[0], observation["action_mask"]
    centre = (size - 1) / 2
    if not 0.0 <= random_prob <= 1.0:
        raise ValueError(f"random_prob is a probability, got {random_prob}")
    if random_prob > 0:
        rng = rng or random.Random()
        if rng.random() < random_prob:
            return int(rng.choice(np.flatnonzero(mask)))

    def score(action: int) -> float:
        row, col = divmod(action, size)
        own, theirs = _line_through(planes[..., 0], row, col), _line_through(planes[..., 1], row, col)
        return max(2 * own + 1, 2 * theirs) - 0.01 * (abs(row - centre) + abs(col - centre))

    return max((int(a) for a in np.flatnonzero(mask)), key=score)


def threats(observation: dict[str, np.ndarray], win_length: int) -> tuple[list[int], list[int]]:
    """(the player's winning cells, the opponent's winning cells): the second is empty when the player can win
    (blocking only matters when it cannot). What :func:`tactics` and :func:`tactical_move` read."""
    planes, mask = observation["observation"], observation["action_mask"]
    mine = winning_cells(planes[..., 0], mask, win_length)
    return mine, [] if mine else winning_cells(planes[..., 1], mask, win_length)


def tactics(observation: dict[str, np.ndarray], agent: str, action: int, win_length: int = 5, win: float = 0.5,
            block: float = 0.5) -> float:
    """A shaping reward for one move (``game.move_reward: envs.gomoku:tactics(win_length=3, ...)``): ``win``
    when the player had a line to complete and completed one, ``block`` when it had none but the opponent
    had exactly one and the move took that cell; 0 otherwise. These are the two things the outcome teaches a
    small policy slowest (docs/notes/learning.md; trained policies took ~20% of their wins and blocked ~15% of
    single threats); a forced defence against two threats earns nothing (no move saves it)."""
    mine, theirs = threats(observation, win_length)
    if mine:
        return win if int(action) in mine else 0.0
    return block if len(theirs) == 1 and int(action) == theirs[0] else 0.0


def tactical_move(observation: dict[str, np.ndarray], win_length: int) -> int | None:
    """The one right move where the position has exactly one: the player's single winning cell, else (no
    win) the opponent's single winning cell, to block; None where there is none or more than one."""
    mine, theirs = threats(observation, win_length)
    found = mine or theirs
    return found[0] if len(found) == 1 else None


def make_chat_dataset(out_dir: str, *, size: int = 9, win_length: int = 5, seed: int = 0, num_train: int = 3000,
                      num_eval: int = 100, list_moves: bool = False, teacher: str = "random",
                      lines: bool = False) -> dict[str, Any]:
    """Chat JSONL (train/eval) for a format-only SFT warm-up of ``context: turn`` games: single decisions
    from games of random legal moves, the board as :func:`render_text` writes it (``list_moves`` as
    :func:`text_listing_moves` does, ``lines`` as :func:`text_with_lines` does) and a random legal move as
    ``<move>B3</move>``: it teaches the reply format and nothing about good play. ``teacher="heuristic"``
    labels the same positions with :func:`heuristic`'s move instead (imitation: can the model learn to read
    lines off the board?). ``teacher="tactics"`` keeps only the positions with one tactical answer (one cell
    that wins, or no win and one cell that blocks the opponent's) labelled with it: a held-out match is then
    the share of wins taken and threats blocked (can the model learn the tactic at all, given the answer?)."""
    if teacher not in ("random", "heuristic", "tactics"):
        raise ValueError(f"teacher must be random, heuristic or tactics, got {teacher!r}")

    def play(rng: random.Random):
        game = env(size=size, win_length=win_length)
        game.reset(seed=rng.randrange(2**31))
        for agent in game.agent_iter():
            obs, _, term, trunc, _ = game.last()
            move = None if term or trunc else int(rng.choice(np.flatnonzero(obs["action_mask"])))
            label = None if move is None else tactical_move(obs, win_length) if teacher == "tactics" else (
                heuristic(obs, agent) if teacher == "heuristic" else move)
            if label is not None:
                yield (render_text(obs, agent, list_moves, win_length if lines else 0),
                       f"<move>{move_name(label, size)}</move>")
            game.step(move)

    tag = (f"gomoku{size}x{size}-{win_length}" + ("-moves" if list_moves else "") + ("-lines" if lines else "")
           + ("" if teacher == "random" else f"-{teacher}"))
    return decision_dataset(out_dir, tag, play, seed=seed, num_train=num_train, num_eval=num_eval)
