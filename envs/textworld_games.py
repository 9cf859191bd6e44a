"""Datasets of generated TextWorld games: distinct games per split, and their walkthroughs as SFT demonstrations.

:func:`make_games` runs one of TextWorld's challenge generators (``tw-treasure_hunter``, ``tw-simple``,
``tw-cooking``, ``tw-coin_collector``: the names ``tw-make`` takes) over a range of seeds per split and
writes the compiled games and one JSONL row per game ``{id, game, walkthrough, objective}`` into a
folder of ``dir`` named by the challenge and a digest of the arguments (so changing an argument builds
new games beside the old instead of reusing games made for other settings). Games are
*distinct*: a game whose world and quest equal an earlier one (any split) is skipped and the next seed
tried, so no evaluation game was seen in training. :func:`make_demos` plays each game's walkthrough
through :class:`envs.textworld_env.TextWorldEnv` (built with ``env_kwargs``: give it the env's kwargs)
and writes the conversation as chat rows (``messages``), so an SFT warm-up trains on exactly what the env shows. Both are idempotent per
directory (a second call with the same directory returns the files already there).

Config::

    dataset: {builder: envs.textworld_games:make_games, dir: .cache/data/tw_treasure,
              kwargs: {challenge: tw-treasure_hunter, settings: {level: 1}, num_train: 50, num_eval: 20}}
    sft:
      dataset: {builder: envs.textworld_games:make_demos, dir: .cache/data/tw_treasure, kwargs: {...the same...}}
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from otray.env import dataset_paths
from otray.types import ConfigError, Task

SEED_STRIDE = 1_000_003  # split s draws seeds seed*SEED_STRIDE + offset(s) + i: ranges that never meet
MAX_TRIES = 20  # seeds tried per game wanted before a split is declared too small to fill


def write_whole(path: Path, lines: list[str]) -> None:
    """Write JSONL lines so that the file appears whole or not at all (a killed build leaves no half split)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.rename(path)


def challenge_settings(challenge: str, settings: dict[str, Any] | None) -> dict[str, Any]:
    """``settings`` completed with the challenge's defaults, through the challenge's own argument parser
    (so a missing required setting, e.g. treasure hunter's ``level``, is named the way ``tw-make`` names it)."""
    from textworld.challenges import CHALLENGES

    if challenge not in CHALLENGES:
        raise ConfigError(f"unknown TextWorld challenge {challenge!r}; known: {sorted(CHALLENGES)}")
    parser = argparse.ArgumentParser(prog=challenge, add_help=False, exit_on_error=False)
    CHALLENGES[challenge][2](parser)
    argv = []
    for key, value in (settings or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    try:
        return vars(parser.parse_args(argv))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError(f"TextWorld challenge {challenge!r}: bad settings {settings!r} ({e}); "
                          f"its settings: {parser.format_usage().strip()}") from None


def game_digest(game: Any) -> str:
    """What makes two generated games the same: the world's facts and the quests' solutions."""
    facts = sorted(str(f) for f in game.world.facts)
    quests = [list(q.commands) for q in game.quests]
    return hashlib.sha1(json.dumps([facts, quests]).encode()).hexdigest()


def _generate(challenge: str, settings: dict[str, Any], seed: int, path: Path) -> Any:
    import textworld
    from textworld.challenges import CHALLENGES

    options = textworld.GameOptions()
    options.seeds, options.path, options.force_recompile = seed, str(path), True
    return CHALLENGES[challenge][1](settings=settings, options=options), options


def make_games(out_dir: str | Path, *, challenge: str = "tw-treasure_hunter", settings: dict[str, Any] | None = None,
               eval_settings: dict[str, Any] | None = None, num_train: int = 50, num_eval: int = 20,
               seed: int = 0, max_opening_chars: int | None = None) -> dict[str, Path]:
    """Generate ``num_train`` + ``num_eval`` distinct games of ``challenge`` (``settings`` as ``tw-make``
    takes them, ``eval_settings`` for the eval split when it should differ, e.g. ``tw-simple``'s ``test``)
    and write ``games/`` plus ``train.jsonl``/``eval.jsonl`` rows in a folder of ``out_dir`` named by them.
    ``max_opening_chars`` skips games whose opening observation (objective, first room and admissible
    commands, as the env shows it) is longer: a small model's context holds the rest (both splits alike)."""
    import textworld

    train_settings = challenge_settings(challenge, settings)
    wanted = {"train": (num_train, train_settings),
              "eval": (num_eval, challenge_settings(challenge, {**(settings or {}), **(eval_settings or {})}))}
    key = json.dumps([challenge, wanted, seed] + ([max_opening_chars] if max_opening_chars else []),
                     sort_keys=True, default=str)
    home = Path(out_dir) / f"{challenge}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    paths, built = dataset_paths(home, {"train": "train.jsonl", "eval": "eval.jsonl"})
    if built:
        return paths
    games_dir = home / "games"
    games_dir.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for index, (split, (count, split_settings)) in enumerate(wanted.items()):
        rows = []
        for i in range(count * MAX_TRIES):
            if len(rows) == count:
                break
            game_seed = seed * SEED_STRIDE + index * (SEED_STRIDE // 2) + i
            path = games_dir / f"{split}-{game_seed}.z8"
            game, options = _generate(challenge, split_settings, game_seed, path)
            digest = game_digest(game)
            if digest in seen:
                continue
            seen.add(digest)
            textworld.generator.compile_game(game, options)
            if max_opening_chars and len(opening(path)) > max_opening_chars:
                for f in path.parent.glob(path.stem + ".*"):
                    f.unlink()
                continue
            walk = list(game.metadata.get("walkthrough") or (game.main_quest.commands if game.main_quest else []))
            rows.append({"id": f"{split}-{game_seed}", "game": str(path.resolve()), "walkthrough": walk,
                         "objective": game.objective, "seed": game_seed})
        if len(rows) < count:
            raise ConfigError(f"{challenge} with settings {settings!r} gave only {len(rows)} distinct {split} games "
                              f"of the {count} asked in {count * MAX_TRIES} seeds: ask for fewer or a harder level")
        write_whole(paths[split], [json.dumps(r) for r in rows])
    return paths


def opening(path: Path) -> str:
    """A game's first observation as :class:`envs.textworld_env.TextWorldEnv` shows it (admissible commands on)."""
    from envs.textworld_env import TextWorldEnv

    env = TextWorldEnv(admissible=True)
    try:
        return env.reset(Task(path.stem, "textworld", {"game": str(path)}))[0]
    finally:
        env.close()


def play_walkthrough(row: dict[str, Any], env_kwargs: dict[str, Any] | None = None,
                     env_class: type | None = None) -> tuple[list[dict[str, str]], bool]:
    """The conversation of a player who types the row's walkthrough, and whether it won the game
    (``env_class``: :class:`envs.textworld_env.TextWorldEnv` or a subclass, built with ``env_kwargs``)."""
    from envs.textworld_env import TextWorldEnv

    env = (env_class or TextWorldEnv)(**(env_kwargs or {}))
    try:
        first, _ = env.reset(Task(row["id"], "textworld", row))
        msgs = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else [])
        msgs.append({"role": "user", "content": first})
        result = None
        for command in row["walkthrough"]:
            msgs.append({"role": "assistant", "content": command})
            result = env.step(command)
            if result.done:
                break
            msgs.append({"role": "user", "content": result.observation})
        return msgs, bool(result is not None and result.info["won"])
    finally:
        env.close()


def make_demos(out_dir: str | Path, *, env_kwargs: dict[str, Any] | None = None, **games: Any) -> dict[str, Path]:
    """Walkthrough demonstrations of :func:`make_games`'s games as chat rows (``demos-<digest>-train.jsonl``,
    ``demos_eval.jsonl``); ``env_kwargs`` as the env's (its ``admissible`` and ``system_prompt`` shape
    what the demonstrations show). A walkthrough that does not win its game is a ConfigError."""
    return write_demos(make_games(out_dir, **games), None, env_kwargs)


def write_demos(rows: dict[str, Path], env_class: type | None, env_kwargs: dict[str, Any] | None) -> dict[str, Path]:
    """Each split's game rows (``rows``: split -> JSONL of ``{id, game, walkthrough}``) played through
    ``env_class`` as chat rows beside them (``demos-<digest of env_kwargs>-<split>.jsonl``), once."""
    tag = hashlib.sha1(json.dumps(env_kwargs or {}, sort_keys=True).encode()).hexdigest()[:10]
    paths, built = dataset_paths(rows["train"].parent, {"train": f"demos-{tag}-train.jsonl",
                                                        "eval": f"demos-{tag}-eval.jsonl"})
    if built:
        return paths
    for split, src in rows.items():
        out = []
        for line in Path(src).read_text().splitlines():
            row = json.loads(line)
            msgs, won = play_walkthrough(row, env_kwargs, env_class)
            if not won:
                raise ConfigError(f"game {row['id']}: its walkthrough {row['walkthrough']} does not win it")
            out.append(json.dumps({"id": f"demo-{row['id']}", "messages": msgs}))
        write_whole(paths[split], out)
    return paths
