"""Any TextArena game (``pip install textarena``) as a PettingZoo ``AECEnv`` for otray's coordinator.

TextArena (https://github.com/LeonGuertler/TextArena) games are text in, text out: the game writes
each player's prompt and reads the player's whole reply itself (TicTacToe finds ``[4]`` in it). This
adapter keeps both: ``observe(agent)`` carries TextArena's own observation text (a byte view beside it)
and an action is the model's reply, handed to the game unparsed. So the game's text (:func:`text`)
renders and parses nothing, and the game itself judges moves:

- an invalid move follows TextArena's rule, not ``game.max_retries``: the game tells the player and
  asks again while its ``error_allowance`` lasts (1 in the bundled games), then the player loses.
  Every invalid reply is counted (``infos[agent]["invalid_move"]``, the job's ``illegal`` counts);
- rewards are TextArena's at the game's end (``env.close()``: +1 / -1 / 0 for two-player games);
- agents are ``player_0`` ... ``player_{N-1}`` (TextArena's player ids), in TextArena's turn order,
  which may give a player several turns in a row (a retry, or a game's own rules);
- an observation is ``{"observation": its bytes as a fixed-length array, "text": TextArena's string}``
  (``otray.games.text_observation``): PettingZoo's ``api_test`` compares the array, the model reads
  the text whole.

Random opponents need the legal moves: :meth:`TextArenaGame.legal_moves` reads TextArena's
"Available Moves: '[0]', '[1]'" line (tic-tac-toe and the other board games print one); a game
that lists none cannot seat ``random`` (a clear error names it). :func:`heuristic` is a
scripted player for ``TicTacToe-v0`` (win, block, centre, corner), to evaluate against.

Configs: ``game.entry: envs.textarena_game:env``, ``game.kwargs: {env_id: TicTacToe-v0-train}``,
``game.text: envs.textarena_game:text``, agents ``player_0``, ``player_1`` (``conf/textarena_tictactoe.yaml``).
The ``-train`` ids use TextArena's board-game observation (the prompt, the last moves and the
board), which suits a small context; the plain ids keep the whole history.
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from gymnasium import spaces
from pettingzoo import AECEnv

from otray.games import GameText, decision_dataset, observation_text, text_observation, text_observation_space

MAX_REPLY_CHARS = 4096  # the action space's bound; replies are model output of max_tokens_per_turn tokens
_MOVES_LINE = re.compile(r"(?:Available|Valid|Legal) [Mm]oves:?([^\n]*)")
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")


def env(env_id: str = "TicTacToe-v0-train", num_players: int = 2, **kwargs: Any) -> "TextArenaGame":
    """The factory ``game.entry`` names: one TextArena game, ``num_players`` seats."""
    return TextArenaGame(env_id, num_players, **kwargs)


class TextArenaGame(AECEnv):
    """One TextArena game (``textarena.make(env_id)``) behind PettingZoo's AEC API; actions are replies."""

    metadata = {"render_modes": [], "name": "textarena_v0", "is_parallelizable": False}
    judges_replies = True  # the coordinator's bridge hands replies over unparsed (otray.actors.rollout.text_bridge)

    def __init__(self, env_id: str, num_players: int = 2, **make_kwargs: Any):
        super().__init__()
        from textarena.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            raise ValueError(f"TextArena has no game {env_id!r}; its ids are the keys of "
                             "textarena.envs.registration.ENV_REGISTRY, "
                             "e.g. TicTacToe-v0 (whole history) or TicTacToe-v0-train (prompt and current board)")
        self.env_id, self.num_players, self.make_kwargs = env_id, num_players, make_kwargs
        self.possible_agents = [f"player_{i}" for i in range(num_players)]
        self.agents = list(self.possible_agents)
        text = spaces.Text(MAX_REPLY_CHARS, charset=string.printable)
        self.action_spaces = {a: text for a in self.possible_agents}
        self.observation_spaces = {a: text_observation_space() for a in self.possible_agents}
        self.game: Any = None
        self.observations: dict[str, str] = {}

    def observation_space(self, agent: str) -> spaces.Space:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        import textarena

        self.game = textarena.make(self.env_id, **self.make_kwargs)
        try:
            self.game.reset(num_players=self.num_players, seed=seed)
        except AssertionError as e:  # TextArena asserts the number of players its game takes
            raise ValueError(f"TextArena game {self.env_id} cannot seat {self.num_players} players: {e}") from None
        self.agents = list(self.possible_agents)
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {"invalid_move": False} for a in self.agents}
        self.observations = {a: "" for a in self.agents}
        self._next_player()

    def _next_player(self) -> None:
        """TextArena's player to move and its observation (read once: TextArena hands it over only once)."""
        player, observation = self.game.get_observation()
        self.agent_selection = f"player_{player}"
        self.observations[self.agent_selection] = _as_text(observation)

    def observe(self, agent: str) -> dict[str, Any]:
        return text_observation(self.observations.get(agent, ""))

    def step(self, action: str | None) -> None:
        if self.terminations[self.agent_selection] or self.truncations[self.agent_selection]:
            return self._was_dead_step(action)
        agent, player = self.agent_selection, int(self.agent_selection.rsplit("_", 1)[1])
        turn = self.game.state.turn
        done, _ = self.game.step(action=str(action))
        invalid = self.game.state.turn == turn or bool(self.game.state.game_info.get(player, {}).get("invalid_move"))
        self.infos = {a: {"invalid_move": invalid and a == agent} for a in self.agents}
        self._cumulative_rewards[agent] = 0.0
        if done:
            rewards, _ = self.game.close()
            self.rewards = {a: float(rewards.get(i, 0.0)) for i, a in enumerate(self.possible_agents)}
            self.terminations = {a: True for a in self.agents}
        else:
            self.rewards = {a: 0.0 for a in self.agents}
            self._next_player()
        self._accumulate_rewards()

    def legal_moves(self, agent: str) -> list[str]:
        """The moves the game lists for ``agent`` now ("Available Moves: '[0]', '[4]'" -> ``["[0]", "[4]"]``)."""
        lines = _MOVES_LINE.findall(self.observations.get(agent, ""))
        if not lines:
            raise ValueError(f"TextArena game {self.env_id} lists no legal moves in its observation, so a random "
                             "player cannot be seated; use a scripted:module:fn opponent instead")
        return _BRACKETED.findall(lines[-1])

    def render(self) -> str:
        return self.observations.get(self.agent_selection, "")

    def close(self) -> None:
        self.game = None


def _as_text(observation: Any) -> str:
    """TextArena's observation as the prompt: a string as it is (its board glyphs and accents kept), anything
    else as JSON."""
    return observation if isinstance(observation, str) else json.dumps(observation, default=str)


def text(**_: Any) -> GameText:
    """The game's text: TextArena writes the prompts, the game reads the replies (``parse`` keeps them whole)."""
    return GameText(render=lambda observation, agent: observation_text(observation), parse=lambda reply: reply,
                    example="[4]")


# --------------------------------------------------------------------------- tic-tac-toe: players and demos

_LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def _tictactoe_board(observation: str) -> list[str]:
    """The last board in a TicTacToe observation, as 9 cells: 'O', 'X' or '' (empty)."""
    rows = re.findall(r"^ ?(\S) \| (\S) \| (\S) ?$", observation, re.M)[-3:]
    if len(rows) != 3:
        raise ValueError("no tic-tac-toe board in this observation")
    return ["" if c.isdigit() else c for row in rows for c in row]


def heuristic(observation: Any, agent: str) -> str:
    """A scripted TicTacToe-v0 player: complete a line, else block the opponent's, else centre, corner, edge."""
    observation = observation_text(observation)
    board = _tictactoe_board(observation)
    mark = re.search(r"you will be '([XO])'", observation)
    me = mark.group(1) if mark else ("O" if agent == "player_0" else "X")
    them = "X" if me == "O" else "O"
    legal = [i for i in range(9) if not board[i]]
    for who in (me, them):  # win first, then block
        for line in _LINES:
            empty = [i for i in line if i in legal]
            if len(empty) == 1 and sum(board[i] == who for i in line) == 2:
                return f"[{empty[0]}]"
    return f"[{next(i for i in (4, 0, 2, 6, 8, 1, 3, 5, 7) if i in legal)}]"


def make_chat_dataset(out_dir: str, *, env_id: str = "TicTacToe-v0-train", seed: int = 0, num_train: int = 2000,
                      num_eval: int = 100) -> dict[str, Any]:
    """Chat JSONL (train/eval) for a format-only SFT warm-up: single decisions from games of random legal
    moves, TextArena's observation as the user turn and a random legal move (``[N]``) as the reply."""

    def play(rng: random.Random):
        game = env(env_id)
        game.reset(seed=rng.randrange(2**31))
        while game.agents and not any(game.terminations.values()):
            agent = game.agent_selection
            move = rng.choice(game.legal_moves(agent))
            yield observation_text(game.observe(agent)), move
            game.step(move)

    return decision_dataset(out_dir, env_id, play, seed=seed, num_train=num_train, num_eval=num_eval)
