"""The environment protocol, task sources, the env registry and ``check_env``.

An otray environment is text in, text out, in Gymnasium's vocabulary::

    class MyEnv(otray.Env):
        system_prompt = "You are ..."            # may be None
        def reset(self, task, seed=None) -> tuple[str, dict]:   # first user message, info
        def step(self, action: str) -> StepResult:               # observation, reward, done, info

``step`` gets the policy's decoded text for one turn. ``StepResult.done`` ends the
episode; otherwise ``observation`` becomes the next user message. An observation may
show images: a list of parts instead of a str, e.g. ``[Image.from_pil(pic), "How many?"]``
(:mod:`otray.vision`; OpenAI ``image_url`` content dicts are taken too), for a
vision-language model (:mod:`otray.vlm`). Rewards are
floats or None, one per step; the job reduces the given ones (sum/mean/max/min); none at all = failed.

Tasks come from a :class:`TaskSource`: a JSONL or Parquet file, or a generator
function. Envs are named in configs either by a registered name (``register``) or
by an import path ``"package.module:Class"``.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otray.structured import import_object
from otray.types import ConfigError, DatasetError, EnvCheckError, EnvStateError, Task
from otray.vision import ImageError, parts, text_of


@dataclass
class StepResult:
    """What ``Env.step`` returns. ``reward`` may be None: no reward signal this turn (the episode's
    reward reduces over the turns that gave one). ``finished=False`` with ``done`` says the env
    ended the episode unfinished (``nonterminal_reward`` applies, as on truncation); an env may
    say the same with ``info["finished"] = False``."""

    observation: str | list[Any]  # a str, or parts: str / otray.vision.Image (see otray.vision)
    reward: float | None
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    finished: bool | None = None


class Env:
    """Base class of otray environments. Subclasses implement ``reset`` and ``step``."""

    system_prompt: str | None = None
    #: Most turns an episode may take; the agent loop truncates past it.
    max_turns: int = 1
    #: Tools offered (OpenAI function dicts), read after ``reset``: the template's ``tools=`` if it takes them,
    #: else the system prompt (``otray.tools.system_with_tools``). ``ToolEnv.tools`` is another thing.
    tool_specs: list[dict[str, Any]] | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (processes, files). Called once per episode."""


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[..., Env]] = {}


def register(name: str, factory: Callable[..., Env]) -> None:
    """Register ``factory`` (a class or function returning an Env) under ``name``."""
    _REGISTRY[name] = factory


# The bundled envs (package ``envs``), resolvable by name before their module is imported.
BUNDLED = {
    "arithmetic": "envs.arithmetic:Arithmetic", "math_word": "envs.math_word:MathWord",
    "calculator": "envs.calculator:Calculator", "math_code": "envs.python_tool:MathWithCode",
    "bandit": "envs.bandit:Bandit", "guess_number": "envs.guess_number:GuessNumber",
    "openreward": "envs.openreward:OpenRewardEnv", "gymnasium": "otray.gym_env:GymnasiumEnv",
    "textworld": "envs.textworld_env:TextWorldEnv", "alfworld": "envs.alfworld_env:AlfWorldEnv",
    "mcp": "envs.mcp_env:McpToolEnv", "verifiers": "envs.verifiers_env:VerifiersEnv",
    "count_shapes": "envs.shapes:CountShapes", "shapes_times": "envs.shapes:ShapesTimes", "geometry3k": "envs.geometry3k:Geometry3K",
    "geometry_figures": "envs.geometry3k:GeometryFigures", "shape_quiz": "envs.shape_quiz:ShapeQuiz",
}


def resolve(entry: str) -> Callable[..., Env]:
    """An env factory from a registered name (bundled names included) or a ``module:attr`` import path."""
    if entry in _REGISTRY:
        return _REGISTRY[entry]
    if entry in BUNDLED:
        return import_object(BUNDLED[entry])
    if ":" not in entry:
        known = ", ".join(sorted(set(_REGISTRY) | set(BUNDLED)))
        raise ConfigError(f"unknown env {entry!r}: give an import path 'module:Class' or a registered name ({known})")
    return import_object(entry)


def make(entry: str, **kwargs: Any) -> Env:
    return resolve(entry)(**kwargs)


# --------------------------------------------------------------------------- task sources


class TaskSource:
    """A finite, indexable list of tasks with seeded, resumable shuffled sampling.

    ``sample(n)`` walks an epoch-wise permutation; ``position`` (epoch, index) is
    all the state needed to resume and draw the same next batch.
    """

    def __init__(self, tasks: list[Task], *, shuffle: bool = True, seed: int = 0):
        if not tasks:
            raise DatasetError("task source is empty: check the dataset path, split name and num_samples")
        self.tasks = tasks
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.tasks)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def sample(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.tasks[self._order[self.index]])
            self.index += 1
        return out

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.index

    def seek(self, position: tuple[int, int]) -> None:
        self.epoch, self.index = position
        self._order = self._permutation(self.epoch)

    # ---- constructors

    @classmethod
    def from_rows(cls, rows: Iterable[dict[str, Any]], env: str, *, limit: int | None = None,
                  shuffle: bool = True, seed: int = 0, id_prefix: str = "") -> TaskSource:
        tasks = []
        for i, row in enumerate(rows):
            if limit is not None and i >= limit:
                break
            if not isinstance(row, dict):
                raise DatasetError(f"row {i} is a {type(row).__name__}, expected a JSON object / table row")
            tasks.append(Task(id=str(row.get("id", f"{id_prefix}{i}")), env=env, data=dict(row)))
        return cls(tasks, shuffle=shuffle, seed=seed)

    @classmethod
    def from_file(cls, path: str | Path, env: str, **kw: Any) -> TaskSource:
        """Tasks from a ``.jsonl`` or ``.parquet`` file, one task per row."""
        path = Path(path)
        if not path.exists():
            raise DatasetError(f"dataset file {str(path)!r} does not exist")
        if path.suffix == ".jsonl":
            rows = []
            with path.open() as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        else:
            raise DatasetError(f"unsupported dataset format {path.suffix!r} for {path}: use .jsonl or .parquet")
        return cls.from_rows(rows, env, id_prefix=f"{path.stem}-", **kw)

    @classmethod
    def from_generator(cls, fn: Callable[[random.Random], dict[str, Any]], n: int, env: str, *,
                       seed: int = 0, shuffle: bool = True) -> TaskSource:
        """``n`` tasks made by ``fn(rng)`` with a seeded ``random.Random``."""
        rng = random.Random(seed)
        return cls.from_rows((fn(rng) for _ in range(n)), env, shuffle=shuffle, seed=seed, id_prefix="gen-")


def dataset_paths(out_dir: str | Path, files: dict[str, str]) -> tuple[dict[str, Path], bool]:
    """For dataset builders: ``{split: out_dir/file}`` (the dir created) and whether all exist
    already (builders are idempotent: same arguments, same files, built once)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {split: out / name for split, name in files.items()}
    return paths, all(p.exists() for p in paths.values())


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[Any]:
    """A text file written whole or not at all, for dataset builders: written to a sibling of ``path`` and renamed
    over it when the block ends. Two processes building the same cached dataset at once (pytest workers) each wrote
    ``path`` in place: one truncated it under the other's writes, which left runs of NUL bytes in the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("w") as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def seed_task(rng: random.Random) -> dict[str, Any]:
    """A task for a data-free env: only a seed, from which the env draws its instance."""
    return {"seed": rng.randrange(2**31)}


def split_seed(seed: int, split: str) -> int:
    """A per-split seed, so that generated train and eval tasks differ (stable across runs)."""
    import zlib

    return seed * 1_000_003 + zlib.crc32(split.encode())


# --------------------------------------------------------------------------- check_env


def check_env(env: Env, task: Task, *, actions: Iterable[str] = ("0", "hello", ""), max_steps: int | None = None,
              seed: int = 0) -> None:
    """Exercise ``env`` the way Gymnasium's ``check_env`` does; raise EnvCheckError on a violation.

    Checks: ``step`` before ``reset`` raises :class:`EnvStateError`; ``reset`` returns
    ``(observation, dict)``; each ``step`` returns a :class:`StepResult` with an observation (a str,
    or parts whose images decode within otray's limits: :func:`otray.vision.parts`),
    a finite real (not bool) reward or None, a bool ``done``, a dict info and ``finished``
    None or a bool; the episode ends
    within ``max_steps`` (default ``env.max_turns``) when fed ``actions`` cyclically;
    ``step`` after the end raises :class:`EnvStateError`; the same seed gives the same
    first observation.
    """
    name = type(env).__name__
    try:
        env.step("0")
    except EnvStateError:
        pass
    except Exception as e:  # noqa: BLE001 - we report what it raised instead
        raise EnvCheckError(f"{name}.step before reset must raise EnvStateError, it raised {type(e).__name__}: {e}") from e
    else:
        raise EnvCheckError(f"{name}.step before reset must raise EnvStateError (call reset first), it returned normally")

    first = _checked_reset(env, task, seed, name)
    again = _checked_reset(env, task, seed, name)
    if first != again:
        raise EnvCheckError(f"{name}.reset is not deterministic: the same task and seed gave {text_of(first)!r} "
                            f"then {text_of(again)!r}" + (" (with different images)" if text_of(first) == text_of(again)
                                                        else ""))

    limit = max_steps if max_steps is not None else max(1, env.max_turns)
    acts = list(actions) or ["0"]
    for i in range(limit):
        result = env.step(acts[i % len(acts)])
        _check_step_result(result, name, i)
        if result.done:
            break
    else:
        raise EnvCheckError(f"{name} never set done=True within {limit} steps (max_turns={env.max_turns}); "
                            "an episode must end by max_turns")
    try:
        env.step("0")
    except EnvStateError:
        pass
    except Exception as e:  # noqa: BLE001
        raise EnvCheckError(f"{name}.step after done must raise EnvStateError, it raised {type(e).__name__}") from e
    else:
        raise EnvCheckError(f"{name}.step after done must raise EnvStateError (call reset first), it returned normally")
    env.close()


def _checked_reset(env: Env, task: Task, seed: int, name: str) -> list[Any]:
    out = env.reset(task, seed=seed)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise EnvCheckError(f"{name}.reset must return (observation: str, info: dict), got {type(out).__name__}")
    obs, info = out
    if not isinstance(info, dict):
        raise EnvCheckError(f"{name}.reset info must be dict, got {type(info).__name__}")
    return _checked_observation(obs, f"{name}.reset")


def _checked_observation(obs: Any, where: str) -> list[Any]:
    """The observation's parts (a str or Image each); an EnvCheckError for anything else or a bad image."""
    try:
        return parts(obs)
    except ImageError as e:
        raise EnvCheckError(f"{where} observation must be a str or a list of parts (str / otray.vision.Image): "
                            f"{e}") from e


def _check_step_result(result: Any, name: str, i: int) -> None:
    where = f"{name}.step (step {i})"
    if not isinstance(result, StepResult):
        raise EnvCheckError(f"{where} must return a StepResult, got {type(result).__name__}")
    _checked_observation(result.observation, where)
    r = result.reward
    if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r))):
        raise EnvCheckError(f"{where} reward must be a finite float or None, got {r!r} ({type(r).__name__})")
    if result.finished is not None and not isinstance(result.finished, bool):
        raise EnvCheckError(f"{where} finished must be None or bool, got {type(result.finished).__name__}")
    if not isinstance(result.done, bool):
        raise EnvCheckError(f"{where} done must be bool, got {type(result.done).__name__}")
    if not isinstance(result.info, dict):
        raise EnvCheckError(f"{where} info must be dict, got {type(result.info).__name__}")


# --------------------------------------------------------------------------- mixtures


class Mixture:
    """Draw tasks from several named sources with sampling weights (seeded, resumable)."""

    def __init__(self, sources: dict[str, TaskSource], weights: dict[str, float], seed: int = 0):
        if not sources:
            raise DatasetError("a task mixture needs at least one source")
        bad = {k: w for k, w in weights.items() if w < 0}
        if bad or sum(weights.get(k, 0.0) for k in sources) <= 0:
            raise ConfigError(f"env sampling weights must be >= 0 with a positive sum, got {weights}")
        self.sources = sources
        self.names = list(sources)
        self.weights = [weights.get(k, 0.0) for k in self.names]
        self.seed = seed
        self.draws = 0

    def sample(self, n: int) -> list[Task]:
        rng = random.Random(self.seed * 7919 + self.draws)
        self.draws += 1
        picks = rng.choices(self.names, weights=self.weights, k=n) if len(self.names) > 1 else self.names * n
        return [task for name in self.names for task in self.sources[name].sample(picks.count(name))]

    def state(self) -> dict[str, Any]:
        return {"draws": self.draws, "positions": {k: list(s.position) for k, s in self.sources.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.draws = state["draws"]
        for k, pos in state["positions"].items():
            self.sources[k].seek(tuple(pos))
