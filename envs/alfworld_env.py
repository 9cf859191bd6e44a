"""ALFWorld's text games as otray envs (``entry: alfworld``), through the ``alfworld`` package.

ALFWorld (Shridhar et al.) is household tasks from ALFRED as TextWorld games: a ``game.tw-pddl`` file
(PDDL domain and problem, a text grammar) that TextWorld's ``PddlEnv`` plays with Fast Downward keeping
the state, wrapped as ALFWorld wraps it (``AlfredDemangler``: "cabinet 1" for ALFRED's object ids;
``AlfredInfos``). The policy reads ALFWorld's own text ("You arrive at countertop 1. On the countertop 1,
you see a egg 1.", "Your task is to: put some egg in fridge.") and types its commands ("go to fridge 1",
"open fridge 1", "move egg 1 to fridge 1"); it wins when the goal holds.

Config (data: ALFWorld's download, ``alfworld-download``, at ``$ALFWORLD_DATA``; or rooms made here in its
layout with ``envs.alfworld_scenes:make_scenes``)::

    envs:
      alfworld:
        entry: alfworld
        kwargs: {admissible: true, max_steps: 50, reward_preset: opentinker}
        dataset: {builder: envs.alfworld_env:alfworld_games, dir: .cache/data/alfworld,
                  kwargs: {task_types: [pick_and_place_simple], num_train: 0, num_eval: 0}}

Everything else is :class:`envs.textworld_env.TextWorldEnv`'s: the command parser, ``admissible``
(ALFWorld's admissible commands at the end of each observation), ``max_steps`` (ALFWorld trains with 50),
the reward options and ``reward_preset: opentinker`` (OpenTinker's ALFWorld shaping: +10 on success,
-0.01 a step, -0.1 an invalid action), and the info (``won``/``correct``, ``steps``,
``invalid_actions``: the job's success rate, turns and invalid-action rate). ``score_rewards`` gives 1 on
the winning turn (a ``PddlEnv`` game's score is 1 when won). ``domain_randomization: true`` numbers the
objects in a random order each episode (ALFWorld's training option). Task rows carry ``task_type``;
one env per task type gives per-type success rates.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
from pathlib import Path
from typing import Any

from envs.textworld_env import TextWorldEnv
from otray.env import dataset_paths, register
from otray.types import ConfigError, DatasetError

SYSTEM_PROMPT = ("You are in a house, doing the task you are given. Reply with one command, such as 'go to "
                 "fridge 1', 'take egg 1 from countertop 1' or 'move egg 1 to fridge 1', and nothing else.")
# ALFWorld's task types by its numbers (its configs' env.task_types)
TASK_TYPES = {1: "pick_and_place_simple", 2: "look_at_obj_in_light", 3: "pick_clean_then_place_in_recep",
              4: "pick_heat_then_place_in_recep", 5: "pick_cool_then_place_in_recep", 6: "pick_two_obj_and_place"}
SPLITS = {"train": "train", "valid_seen": "eval_in_distribution", "valid_unseen": "eval_out_of_distribution"}
GAME_KEYS = ("pddl_domain", "grammar", "pddl_problem")


def check_game_file(path: Path) -> dict[str, Any]:
    """A ``game.tw-pddl`` file's JSON, refused with a clear error when it is not one ALFWorld made."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path} is not an ALFWorld game file (not JSON: {e}); rebuild the dataset") from None
    missing = [k for k in GAME_KEYS if not isinstance(data, dict) or not isinstance(data.get(k), str)]
    if missing:
        raise DatasetError(f"{path} is not an ALFWorld game file (no {', '.join(missing)}): make it with "
                           "alfworld-generate")
    return data


class AlfWorldEnv(TextWorldEnv):
    """One ALFWorld game per episode (see the module docstring)."""

    KIND = "an ALFWorld env"
    BUILDER = "envs.alfworld_env:alfworld_games (or envs.alfworld_scenes:make_scenes)"
    KWARGS = TextWorldEnv.KWARGS + ("domain_randomization",)

    def __init__(self, domain_randomization: bool = False, max_steps: int = 50,
                 system_prompt: str | None = SYSTEM_PROMPT, **kwargs: Any):
        super().__init__(max_steps=max_steps, system_prompt=system_prompt, **kwargs)
        self.domain_randomization = bool(domain_randomization)
        self._pddl: Any = None

    def open_game(self, path: Path) -> Any:
        """A pooled ``PddlEnv`` wrapped as ALFWorld's ``AlfredTWEnv`` wraps it, with the game loaded."""
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        check_game_file(path)
        self._pddl = _POOL.take()
        env = AlfredInfos(AlfredDemangler(self._pddl, shuffle=self.domain_randomization))
        try:
            env.load(str(path))
        except Exception as e:  # Fast Downward's translator on a problem it cannot read
            raise DatasetError(f"{path}: ALFWorld could not load this game ({type(e).__name__}: {e})") from None
        return env

    def close(self) -> None:
        self._game, self._live = None, False
        pddl, self._pddl = self._pddl, None
        if pddl is not None:
            _POOL.give(pddl)


class PddlPool:
    """Idle ``PddlEnv``\\ s of this process, one per episode in play at a time. Each ``PddlEnv`` loads its own
    copy of Fast Downward's 34 MB library (the library keeps its state in globals), which is never unloaded:
    made afresh per episode that leaked ~1.1 MB an episode (measured: 291 MB after 200 episodes). ALFWorld
    itself keeps one per batch slot and loads each new game into it; so does this pool."""

    def __init__(self) -> None:
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        import textworld
        from textworld.envs import PddlEnv

        return PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True, lost=True, feedback=True,
                                          extras=["gamefile"]))

    def give(self, env: Any) -> None:
        with self._lock:
            self._idle.append(env)


_POOL = PddlPool()


def alfworld_games(out_dir: str | Path, *, data: str | None = None, task_types: list[Any] | None = None,
                   num_train: int = 0, num_eval: int = 0, eval_split: str = "valid_unseen") -> dict[str, Path]:
    """Rows ``{id, game, walkthrough, task_type}`` for ALFWorld's games: ``train`` from its ``train``
    split, ``eval`` from ``eval_split`` (``valid_unseen``: rooms never seen in training; ``valid_seen``).

    ``data``: the folder that holds ``json_2.1.1`` (default ``$ALFWORLD_DATA``, where ``alfworld-download``
    puts it; a relative path is inside ``out_dir``). The games are chosen by ALFWorld's own
    ``AlfredTWEnv.collect_game_files`` (its task-type filter, no movable or sliced trials, solvable games
    only, the first ``num_train``/``num_eval``; 0 = all), so a job trains on what ALFWorld would.
    ``task_types``: names or ALFWorld's numbers (default: all six)."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    if eval_split not in ("valid_seen", "valid_unseen"):
        raise ConfigError(f"eval_split {eval_split!r}: ALFWorld's held-out splits are valid_seen and valid_unseen")
    names = {v: k for k, v in TASK_TYPES.items()}
    numbers = [t if isinstance(t, int) else names.get(t) for t in (task_types or list(TASK_TYPES))]
    if None in numbers or not set(numbers) <= set(TASK_TYPES):
        raise ConfigError(f"task_types {task_types!r}: ALFWorld's task types are {TASK_TYPES}")
    root = _data_root(out_dir, data)
    key = json.dumps([str(root), sorted(numbers), num_train, num_eval, eval_split])
    home = Path(out_dir) / f"alfworld-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    paths, built = dataset_paths(home, {"train": "train.jsonl", "eval": "eval.jsonl"})
    if built:
        return paths
    config = {"env": {"goal_desc_human_anns_prob": 0, "task_types": numbers},
              "dataset": {"data_path": str(root / "train"), "eval_id_data_path": str(root / "valid_seen"),
                          "eval_ood_data_path": str(root / "valid_unseen"), "num_train_games": num_train,
                          "num_eval_games": num_eval}}
    for split, source, count in (("train", "train", num_train), ("eval", eval_split, num_eval)):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its counts
            files = AlfredTWEnv(config, train_eval=SPLITS[source]).game_files
        if not files:
            raise DatasetError(f"no solvable ALFWorld games of types {sorted(numbers)} in {root / source}")
        rows = [_row(Path(f), root) for f in sorted(files)]
        tmp = paths[split].with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(paths[split])
    return paths


def _data_root(out_dir: str | Path, data: str | None) -> Path:
    if data is None:
        if not os.environ.get("ALFWORLD_DATA"):
            raise DatasetError("ALFWorld's data is not on this machine: download it with alfworld-download and set "
                               "ALFWORLD_DATA to its folder, or make rooms in its layout with "
                               "envs.alfworld_scenes:make_scenes")
        base = Path(os.environ["ALFWORLD_DATA"])
    else:
        base = Path(out_dir) / data  # an absolute data replaces out_dir (an admin's; users' are relative)
    root = base / "json_2.1.1" if (base / "json_2.1.1").is_dir() else base
    if not root.is_dir():
        raise DatasetError(f"ALFWorld data folder {root} does not exist")
    return root


def _row(game: Path, root: Path) -> dict[str, Any]:
    data = check_game_file(game)
    traj = json.loads((game.parent / "traj_data.json").read_text())
    return {"id": str(game.parent.relative_to(root)), "game": str(game.resolve()),
            "walkthrough": list(data.get("walkthrough") or []), "task_type": traj["task_type"]}


def alfworld_demos(out_dir: str | Path, *, env_kwargs: dict[str, Any] | None = None, **games: Any) -> dict[str, Path]:
    """The games' walkthroughs (ALFWorld's expert plans) played through :class:`AlfWorldEnv` as chat rows,
    for an SFT warm-up (``games``: :func:`alfworld_games`'s arguments)."""
    from envs.textworld_games import write_demos

    return write_demos(alfworld_games(out_dir, **games), AlfWorldEnv, env_kwargs)


def scene_demos(out_dir: str | Path, *, env_kwargs: dict[str, Any] | None = None, **scenes: Any) -> dict[str, Path]:
    """Like :func:`alfworld_demos`, for rooms made by :func:`envs.alfworld_scenes.make_scenes`."""
    from envs.alfworld_scenes import make_scenes
    from envs.textworld_games import write_demos

    return write_demos(make_scenes(out_dir, **scenes), AlfWorldEnv, env_kwargs)


register("alfworld", AlfWorldEnv)
