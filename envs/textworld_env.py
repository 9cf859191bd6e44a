"""TextWorld games as otray envs (``entry: textworld``), through the ``textworld`` package.

Config::

    envs:
      treasure:
        entry: textworld
        kwargs: {admissible: true, max_steps: 8}
        dataset: {builder: envs.textworld_games:make_games, dir: .cache/data/tw_treasure,
                  kwargs: {challenge: tw-treasure_hunter, settings: {level: 1}, num_train: 50, num_eval: 20}}

One episode is one game: ``task.data["game"]`` names a compiled game file (``.z8`` or ``.ulx``; the
dataset builder :func:`envs.textworld_games.make_games` writes them and their rows). The first
observation is the game's objective and opening text; each turn the policy's reply is parsed into one
command (:func:`parse_command`: its first line, without a ``>`` prompt or an ``Action:`` label) and sent
to the game, whose answer is the next observation. With ``admissible: true`` every observation ends
with the commands the game accepts there (TextWorld's ``admissible_commands``).

Rewards, per turn (all options; OpenTinker's ALFWorld shaping is ``win_reward: 10, step_reward: -0.01,
invalid_action_reward: -0.1, score_rewards: false``):

- ``score_rewards`` (default true): the game's score change this turn divided by its ``max_score``, so
  a solved game's intermediate rewards sum to 1;
- ``win_reward`` / ``lose_reward`` on the turn the game is won / lost;
- ``step_reward`` every turn; ``invalid_action_reward`` for a command that is not admissible there.

A command is *invalid* when it is not among the game's admissible commands at that point (compared
case- and space-insensitively); it is still sent, and the game's own answer ("That's not a verb I
recognise.") is what the policy reads. The episode ends when the game is won or lost (``finished``), or
after ``max_steps`` commands (unfinished: the job's ``nonterminal_reward`` applies). ``info`` carries
``correct`` (won: the job's success rate), ``won``, ``lost``, ``score``, ``max_score``, ``steps`` and
``invalid_actions`` (the job reports ``invalid_action_rate``: invalid commands per turn).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from otray.env import Env, StepResult, register
from otray.types import ConfigError, DatasetError, EnvStateError, Task

SYSTEM_PROMPT = ("You are playing a text adventure game. Reply with one command for the game, such as "
                 "'go north' or 'take key from table', and nothing else.")
_BANNER = re.compile(r"^[\s$|\\/_<>]*[$|\\/_][\s$|\\/_<>]*$")  # the ASCII-art title TextWorld games open with
_NOT_TYPABLE = re.compile(r"[^ -~]+")  # the game reads printable ASCII; a NUL byte crashes its interpreter
MAX_COMMAND_CHARS = 200
_LABEL = re.compile(r"^\s*(?:>|action\s*:|command\s*:)\s*", re.IGNORECASE)

# OpenTinker's ALFWorld reward shaping (+10 on success, -0.01 per step, -0.1 per invalid action), by name
PRESETS: dict[str, dict[str, Any]] = {
    "opentinker": {"win_reward": 10.0, "step_reward": -0.01, "invalid_action_reward": -0.1, "score_rewards": False},
}


def parse_command(text: str) -> str:
    """The game command in a policy's reply: its first non-empty line without a ``>`` prompt or an
    ``Action:``/``Command:`` label, surrounding quotes, backticks and a final period, lower-cased with
    single spaces, of printable ASCII only (other characters, which a player could not type, become
    spaces: the Z-machine interpreter crashes its process on a NUL byte), at most ``MAX_COMMAND_CHARS``.
    An empty reply is the empty command (the game answers it; it counts as invalid)."""
    for line in text.splitlines():
        line = _NOT_TYPABLE.sub(" ", line)
        line = _LABEL.sub("", line).strip().strip("`'\"").rstrip(".").strip()
        if line:
            return " ".join(line.lower().split())[:MAX_COMMAND_CHARS]
    return ""


def clean_feedback(text: str) -> str:
    """A game's answer as the policy reads it: without the title banner, the trailing ``>`` prompt and
    the status bar after it, and runs of blank lines."""
    if "\n>" in text:
        text = text[:text.rindex("\n>")]
    lines = [ln.rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if not _BANNER.match(ln)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def check_story_file(path: str | Path) -> None:
    """Refuse a game file the interpreter would choke on before it is loaded: TextWorld's Z-machine
    interpreter runs in this process and ends it (``Fatal error: Unknown Z-code version``) on a bad file,
    which would take a rollout worker down with it. A Z-machine file needs a version byte 1-8, a declared
    length within the file and the header's checksum; a Glulx file, its magic number."""
    data = Path(path).read_bytes()
    if data[:4] == b"Glul":
        return
    scale = {1: 2, 2: 2, 3: 2, 4: 4, 5: 4, 6: 8, 7: 8, 8: 8}.get(data[0] if data else 0)
    length = int.from_bytes(data[0x1A:0x1C], "big") * (scale or 0)
    if scale is None or len(data) < 64 or not 64 <= length <= len(data):
        raise DatasetError(f"{path} is not a Z-machine or Glulx game file (bad header): rebuild the dataset")
    if sum(data[0x40:length]) % 65536 != int.from_bytes(data[0x1C:0x1E], "big"):
        raise DatasetError(f"{path} is damaged (its checksum does not match): rebuild the dataset")


def _infos() -> Any:
    from textworld import EnvInfos

    return EnvInfos(admissible_commands=True, won=True, lost=True, score=True, max_score=True, objective=True,
                    feedback=True)


class TextWorldEnv(Env):
    """One TextWorld game per episode (see the module docstring)."""

    KIND = "a TextWorld env"
    BUILDER = "envs.textworld_games:make_games"
    KWARGS = ("admissible", "max_steps", "score_rewards", "win_reward", "lose_reward", "step_reward",
              "invalid_action_reward", "reward_preset", "system_prompt")

    def __init__(self, admissible: bool = True, max_steps: int = 10, score_rewards: bool = True,
                 win_reward: float = 0.0, lose_reward: float = 0.0, step_reward: float = 0.0,
                 invalid_action_reward: float = 0.0, reward_preset: str | None = None,
                 system_prompt: str | None = SYSTEM_PROMPT, **unknown: Any):
        if unknown:
            raise ConfigError(f"envs.<name>.kwargs: unknown key(s) {sorted(unknown)} for {self.KIND}; valid: "
                              f"{', '.join(self.KWARGS)} (the game comes from the task rows: build them with "
                              f"{self.BUILDER})")
        if reward_preset is not None:
            if reward_preset not in PRESETS:
                raise ConfigError(f"reward_preset {reward_preset!r} is unknown; known: {sorted(PRESETS)}")
            p = PRESETS[reward_preset]
            score_rewards, win_reward = p["score_rewards"], p["win_reward"]
            step_reward, invalid_action_reward = p["step_reward"], p["invalid_action_reward"]
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {max_steps}")
        self.admissible, self.max_turns = admissible, int(max_steps)
        self.score_rewards, self.win_reward, self.lose_reward = score_rewards, win_reward, lose_reward
        self.step_reward, self.invalid_action_reward = step_reward, invalid_action_reward
        self.system_prompt = system_prompt
        self._game: Any = None
        self._state: Any = None
        self._live = False

    # ------------------------------------------------------------------ episode

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.close()
        path = task.data.get("game")
        if not path:
            raise DatasetError(f"task {task.id!r} names no 'game' file: build the rows with "
                               f"{self.BUILDER} (or give each row a 'game' path)")
        if not Path(path).is_file():
            raise DatasetError(f"task {task.id!r}: the game file {path!r} does not exist (rebuild the dataset: "
                               "delete its directory and run the job again)")
        self._game = self.open_game(Path(path))
        self._state = self._game.reset()
        self._live, self._steps, self._invalid, self._score = True, 0, 0, 0
        self._max_score = max(1, int(self._state.max_score or 0))
        opening = clean_feedback(self._state.feedback or "")
        return self._with_commands(opening), self._info()

    def open_game(self, path: Path) -> Any:
        """The game file as a started ``textworld`` environment (checked first: see :func:`check_story_file`)."""
        import textworld

        check_story_file(path)
        with warnings.catch_warnings():  # Jericho warns that it cannot track a generated game's score: TextWorld does
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            return textworld.start(str(path), request_infos=_infos())

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise EnvStateError("TextWorldEnv.step called before reset (or after the episode ended)")
        command = parse_command(action)
        valid = self._admissible()
        invalid = command not in valid
        self._steps += 1
        self._invalid += invalid
        self._state, score, game_over = self._game.step(command)
        won, lost = bool(self._state.won), bool(self._state.lost)
        reward = self.step_reward + (self.invalid_action_reward if invalid else 0.0)
        if self.score_rewards:
            reward += (int(score) - self._score) / self._max_score
        reward += self.win_reward * won + self.lose_reward * lost
        self._score = int(score)
        finished = won or lost or bool(game_over)
        done = finished or self._steps >= self.max_turns
        text = clean_feedback(self._state.feedback or "")
        if done:
            self.close()  # the interpreter is freed as soon as the game ends
        return StepResult(text if done else self._with_commands(text), reward, done, self._info(),
                          finished=finished if done else None)

    def close(self) -> None:
        game, self._game, self._live = self._game, None, False
        if game is not None:
            game.close()

    # ------------------------------------------------------------------ helpers

    def _admissible(self) -> set[str]:
        return {" ".join(c.lower().split()) for c in (self._state.admissible_commands or [])}

    def _with_commands(self, text: str) -> str:
        if not self.admissible:
            return text
        return f"{text}\n\nAdmissible commands: {', '.join(sorted(self._state.admissible_commands or []))}."

    def _info(self) -> dict[str, Any]:
        won = bool(self._state.won) if self._state is not None else False
        return {"correct": won, "won": won, "lost": bool(self._state.lost), "score": self._score,
                "max_score": self._max_score, "steps": self._steps, "invalid_actions": self._invalid}


register("textworld", TextWorldEnv)
