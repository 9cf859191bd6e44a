"""What a non-admin's job config may name: the checks the ResourceManager runs at submit.

The trust model (docs/security.md): whoever reaches Ray is an admin; users reach the
cluster through keys, and a user's config is data, not code. So, for a caller who is
not an admin, :func:`confine` refuses or rewrites everything in a config that would run
or touch something the caller does not own:

- **Import paths** (``module:attr`` in ``dataset.builder`` / ``generator``, ``envs.X.entry``,
  ``game.entry`` / ``game.text``, ``scripted:module:fn`` policies, and import-path
  strings inside ``kwargs`` such as the gymnasium adapter's ``env`` or an OpenReward
  env's ``base_url: local:MODULE``, an MCP server's ``stdio:MODULE``, a verifiers ``env_id``) must name a
  module of
  :data:`BUNDLED_MODULES` or one an
  admin allowed (``otray modules allow``), and an attribute defined in that module (its
  ``__module__``; not one it imported: ``envs.x:os`` and ``otray.env:import_object`` are refused),
  or one of the :data:`REEXPORTS`.
- **Commands**: an MCP server given as a command (``cmd:...`` in kwargs) is refused.
- **Checkpoints** (``checkpoint.resume_from``, ``infer.checkpoint``, ``frozen:`` policies)
  must be ``JOB_ID[:STEP]`` references, which the ResourceManager checks are the
  caller's; a directory path is refused.
- **Models**: ``model.path`` is ``tiny[-SHAPE][:SEED]`` or a hub id (``org/name``), rewritten to
  ``hub:org/name``, which the loader refuses when a local path of that name exists (so a hub id never
  reads a directory on the node); ``model.cache_dir`` stays the default.
- **Files**: ``job.output_dir`` and ``infer.out`` stay the default (the job goes to the caller's area);
  dataset ``dir``\\ s and split ``path``\\ s must be relative, without ``..``, and are
  rewritten into the caller's own area (``users/<name>/`` next to the registry); a builder's
  ``data`` kwarg (a data folder, which builders read relative to ``dir``) must be relative too.

Admins pass unchanged. Nothing here imports user code: modules are checked by name.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from otray.models import HUB_ONLY, is_tiny_spec
from otray.types import OtrayError

# The modules shipped with otray whose attributes a non-admin may name. Fixed here, not
# discovered from the file system: a file a job managed to write is never on this list.
BUNDLED_MODULES = frozenset({
    "envs.alfworld_env", "envs.alfworld_scenes", "envs.answers", "envs.arithmetic", "envs.bandit", "envs.calculator",
    "envs.coin", "envs.connect_four_text",
    "envs.frozen_lake", "envs.geometry3k", "envs.gomoku", "envs.guess_number", "envs.math_word", "envs.mcp_calc_server",
    "envs.mcp_env", "envs.openreward",
    "envs.openreward_examples", "envs.python_tool", "envs.rps", "envs.shape_quiz", "envs.shapes", "envs.textworld_env", "envs.textworld_games",
    "envs.textarena_game", "envs.tictactoe_text", "envs.verifiers_env", "envs.vf_reverse_text",
    "otray.env", "otray.games",
    "pettingzoo.classic.tictactoe_v3", "pettingzoo.classic.connect_four_v3",  # PettingZoo's own games, unmodified
})

# Attributes a bundled module re-exports from another module on purpose (PettingZoo's versioned game
# modules export their game's factory): named one by one. Anything else must be defined in the module
# a config names (its ``__module__``), not merely imported there (``otray.env:import_object`` is refused).
# otray's own modules that configs may name hold library code too (``otray.env:make`` builds any env
# from a string): users may name only these attributes of them.
OTRAY_ATTRIBUTES = {"otray.env": frozenset({"seed_task"}),
                    "otray.games": frozenset({"GameText", "generic_parse", "generic_render", "legal_actions"})}
REEXPORTS = frozenset({"pettingzoo.classic.tictactoe_v3:env", "pettingzoo.classic.tictactoe_v3:raw_env",
                       "pettingzoo.classic.connect_four_v3:env", "pettingzoo.classic.connect_four_v3:raw_env"})

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


class ForbiddenConfigError(OtrayError, PermissionError):
    """A non-admin's config names code, a path or a checkpoint that only an admin may use."""


@dataclass(frozen=True)
class Caller:
    """Who submits: a user name and whether that user is an admin (auth off: ``local``, admin)."""

    name: str
    admin: bool


def home() -> Path:
    """otray's per-cluster state directory: ``$OTRAY_HOME``, default ``~/.otray`` (absolute)."""
    return Path(os.environ.get("OTRAY_HOME") or "~/.otray").expanduser().absolute()


# --------------------------------------------------------------------------- finding references


def _dataset_sections(cfg: Any) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(key prefix, dataset section, splits) of every dataset the config names."""
    yield "sft", cfg.sft.dataset, cfg.sft.splits
    for name, env in cfg.envs.items():
        yield f"envs.{name}", env.dataset, env.splits


def _kwarg_strings(value: Any, key: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _kwarg_strings(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _kwarg_strings(v, f"{key}[{i}]")


def _kwarg_sections(cfg: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(config key, kwargs) of every kwargs mapping a config hands to code: envs, datasets, the game."""
    for prefix, ds, _ in _dataset_sections(cfg):
        yield f"{prefix}.dataset.kwargs", ds.kwargs
    for name, env in cfg.envs.items():
        yield f"envs.{name}.kwargs", env.kwargs
    if cfg.game is not None:
        yield "game.kwargs", cfg.game.kwargs


def url_refs(cfg: Any) -> list[tuple[str, str]]:
    """(config key, URL) of every network address in the config's kwargs (an OpenReward env's
    ``base_url``, and any other ``scheme://`` string code could connect to)."""
    return [(k, text) for key, kwargs in _kwarg_sections(cfg) for k, text in _kwarg_strings(kwargs, key)
            if _URL.match(text)]


def normal_url(url: str) -> str:
    """A URL as allow-lists hold it: without a trailing slash."""
    return url.strip().rstrip("/")


def import_refs(cfg: Any) -> list[tuple[str, str]]:
    """(config key, ``module:attr`` or ``module``) of everything in ``cfg`` that imports code."""
    from otray.env import BUNDLED
    from otray.policies import PolicySpec, move_reward_call

    refs: list[tuple[str, str]] = []
    for prefix, ds, _ in _dataset_sections(cfg):
        refs += [(f"{prefix}.dataset.{k}", v) for k, v in (("builder", ds.builder), ("generator", ds.generator)) if v]
    for name, env in cfg.envs.items():
        if env.entry != "gymnasium":  # the adapter itself is bundled; its kwargs are checked below
            refs.append((f"envs.{name}.entry", BUNDLED.get(env.entry, env.entry)))
    for key, kwargs in _kwarg_sections(cfg):
        refs += _kwarg_refs(kwargs, key)
    if cfg.game is not None:
        refs += [("game.entry", cfg.game.entry), ("game.text", cfg.game.text)]
        specs = [(f"game.policies.{a}", p) for a, p in cfg.game.policies.items()]
        specs += [(f"game.seatings[{i}].{a}", p) for i, seats in enumerate(cfg.game.seatings) for a, p in seats.items()]
        specs += [(f"game.eval_opponents[{i}]", p) for i, p in enumerate(cfg.game.eval_opponents)]
        specs += [(f"game.league.fixed[{i}]", p) for i, p in enumerate(cfg.game.league.fixed)]
        refs += [(key, PolicySpec.parse(p).call()[0]) for key, p in specs if PolicySpec.parse(p).kind == "scripted"]
        if cfg.game.move_reward:
            refs.append(("game.move_reward", move_reward_call(cfg)[0]))
    return refs


def _kwarg_refs(kwargs: dict[str, Any], key: str) -> list[tuple[str, str]]:
    """Import paths hidden in kwargs: ``local:MODULE`` URLs, ``stdio:MODULE`` MCP servers, a verifiers
    ``env_id`` (the module it names) and ``module:attr`` strings."""
    out = []
    for k, text in _kwarg_strings(kwargs, key):
        # a verifiers env's env_id names a module it imports; a game's (TextArena) names a registered game only
        if k.endswith(".env_id") and not k.startswith("game."):
            out.append((k, text.replace("-", "_").split("/")[-1]))
        elif text.startswith(("local:", "stdio:")):
            out.append((k, text.partition(":")[2]))
        elif _IMPORT_PATH.fullmatch(text):
            out.append((k, text))
    return out


def checkpoint_refs(cfg: Any) -> list[tuple[str, str]]:
    """(config key, value) of every checkpoint the config loads."""
    from otray.policies import frozen_policies

    refs = [("checkpoint.resume_from", cfg.checkpoint.resume_from)]
    if cfg.job.kind == "infer":
        refs.append(("infer.checkpoint", cfg.infer.checkpoint))
    refs += [("game.policies", f"frozen:{spec.arg}") for spec in frozen_policies(cfg)]
    return [(k, v) for k, v in refs if v]


# --------------------------------------------------------------------------- checks


def check_import(key: str, ref: str, allowed: frozenset[str]) -> None:
    """Refuse ``ref`` (``module:attr`` or ``module``) unless its module is allowed and the attribute
    is the module's own (defined there, public)."""
    module, _, attr = ref.partition(":")
    if module not in allowed:
        raise ForbiddenConfigError(
            f"{key}: {ref!r} is not code this cluster lets users run. Bundled modules and the ones an admin "
            f"allowed (otray modules allow) are: {', '.join(sorted(allowed))}")
    if not attr:
        return
    if attr.startswith("_"):
        raise ForbiddenConfigError(f"{key}: {ref!r} names a private attribute; name a public env, builder or function")
    if module in OTRAY_ATTRIBUTES and attr not in OTRAY_ATTRIBUTES[module]:
        raise ForbiddenConfigError(f"{key}: {ref!r} is otray's own machinery, not something a config names; "
                                   f"from {module} a config may name {', '.join(sorted(OTRAY_ATTRIBUTES[module]))}")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return  # the job fails later with the import error; nothing ran that the caller chose
    if inspect.ismodule(obj):
        raise ForbiddenConfigError(f"{key}: {ref!r} is the module {obj.__name__}, which {module} imported; "
                                   "name what the module itself defines")
    home_module = getattr(obj, "__module__", None) or module
    own = home_module == module or ref in REEXPORTS
    if (inspect.isclass(obj) or inspect.isroutine(obj)) and not own:
        raise ForbiddenConfigError(f"{key}: {ref!r} is not defined in {module} (it is {home_module}:{attr}); "
                                   "name what the module itself defines")


def _relative(key: str, value: str) -> PurePosixPath:
    path = PurePosixPath(value)
    if path.is_absolute() or value.startswith("~") or ".." in path.parts:
        raise ForbiddenConfigError(f"{key}: {value!r} is outside your area; give a relative path without '..' "
                                   "(it is kept under your own directory on the cluster)")
    return path


def confine(cfg: Any, caller: Caller, allowed: frozenset[str], area: Path, urls: frozenset[str] = frozenset()) -> Any:
    """Check (and, for file paths, rewrite in place) a non-admin's config; admins pass unchanged.
    ``allowed``: the modules users may name; ``urls``: the network addresses (``otray urls allow``).
    ``area`` is the caller's own directory (the ResourceManager's ``users/<name>``): dataset files
    go under ``area/data``. Raises :class:`ForbiddenConfigError` naming the key and what to do instead."""
    from otray.config import JobSection, ModelSection
    from otray.names import parse_ref

    if caller.admin:
        return cfg
    for key, ref in import_refs(cfg):
        check_import(key, ref, allowed)
    for key, kwargs in _kwarg_sections(cfg):
        for k, text in _kwarg_strings(kwargs, key):
            if text.startswith("cmd:"):
                raise ForbiddenConfigError(
                    f"{k}: {text!r} starts a command, and an MCP server's command is code only an admin may run; "
                    "name a server module ('stdio:MODULE', bundled or allowed by an admin with `otray modules "
                    "allow`) or an address an admin allowed")
    for key, url in url_refs(cfg):
        if normal_url(url) not in urls:
            raise ForbiddenConfigError(
                f"{key}: {url!r} is not an address an admin allowed; a user's env reaches the OpenReward service "
                "(leave base_url unset), a bundled server (base_url: local:MODULE), or an address an admin allowed "
                "with `otray urls allow URL` (the cluster's OpenReward key goes only to those)")
    for key, value in checkpoint_refs(cfg):
        if parse_ref(value.removeprefix("frozen:")) is None:
            raise ForbiddenConfigError(f"{key}: {value!r} is a directory; only an admin may load checkpoints by "
                                       "path. Name one of your jobs' checkpoints as JOB_ID or JOB_ID:STEP")
    model = cfg.model.path.removeprefix(HUB_ONLY)
    if _HUB_ID.fullmatch(model) and ".." not in model:  # (a tiny spec has no slash)
        cfg.model.path = HUB_ONLY + model  # loaded from the hub only, never from a local dir of that name
    elif not is_tiny_spec(model):
        raise ForbiddenConfigError(f"model.path: {model!r} is neither a hub model id ('org/name') nor tiny "
                                   f"('tiny', 'tiny:SEED', 'tiny-100m:SEED'); an admin can load models from directories")
    for key, value, default in (("model.cache_dir", cfg.model.cache_dir, ModelSection.cache_dir),
                                ("job.output_dir", cfg.job.output_dir, JobSection.output_dir),
                                ("infer.out", cfg.infer.out, None)):
        if value != default:
            raise ForbiddenConfigError(f"{key} is set by the cluster for users (your jobs' files go to your own "
                                       f"area); remove it from the config (it is {value!r})")
    area = area / "data"
    for prefix, ds, splits in _dataset_sections(cfg):
        ds.dir = str(area / _relative(f"{prefix}.dataset.dir", ds.dir))
        if isinstance(ds.kwargs.get("data"), str):  # a builder's data folder (ALFWorld's): inside ``dir``
            _relative(f"{prefix}.dataset.kwargs.data", ds.kwargs["data"])
        for split, sc in splits.items():
            if sc.path:
                sc.path = str(area / _relative(f"{prefix}.splits.{split}.path", sc.path))
    return cfg
