"""Structured configs from YAML, dicts and dotted overrides, with every key checked.

The machinery under both config schemas (the job's in :mod:`otray.config`, the Serve
app's in :mod:`otray.serve.config`): OmegaConf merges a file or dict and ``key=value``
overrides onto a dataclass schema; an unknown key anywhere is a :class:`ConfigError` that
names it and the closest valid key, and a value of the wrong type one that names the key.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from otray.types import ConfigError


def check_keys(data: Any, schema: type, prefix: str) -> None:
    """Unknown keys anywhere in ``data`` -> ConfigError naming the closest valid key."""
    if not isinstance(data, dict):
        return
    hints = get_type_hints(schema)
    valid = [f.name for f in fields(schema)]
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys here: {', '.join(valid)}"
            raise ConfigError(f"unknown config key '{where}'{hint}")
        sub = _unwrap(hints[key])
        if is_dataclass(sub):
            check_keys(value, sub, where + ".")
        elif get_origin(sub) is dict and is_dataclass(_unwrap(get_args(sub)[1])) and isinstance(value, dict):
            for name, item in value.items():
                check_keys(item, _unwrap(get_args(sub)[1]), f"{where}.{name}.")
        elif get_origin(sub) is list and is_dataclass(_unwrap(get_args(sub)[0])) and isinstance(value, list):
            for i, item in enumerate(value):
                check_keys(item, _unwrap(get_args(sub)[0]), f"{where}[{i}].")


def one_of(value: str, options: tuple[str, ...] | list[str], key: str) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(options)}")


def _unwrap(tp: Any) -> Any:
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def load_structured(source: Any, overrides: list[str] | None, schema: type) -> Any:
    """``source`` (YAML path, dict or a ``schema`` instance) + overrides -> a ``schema`` instance, keys checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    Config = schema  # noqa: N806 - the schema being loaded
    if isinstance(source, Config):
        base = OmegaConf.structured(source)
        data: Any = {}
    elif isinstance(source, dict):
        base, data = OmegaConf.structured(Config), source
    elif not isinstance(source, (str, Path)):
        raise ConfigError(f"a config is a mapping of sections (job:, model:, algo: ...) or a YAML path, "
                          f"not a {type(source).__name__}")
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = read_yaml(path)
        base = OmegaConf.structured(Config)
    check_keys(data, Config, "")
    layers = [OmegaConf.create(data)]
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. algo.learning_rate=2e-5)")
        dot = OmegaConf.from_dotlist([item])
        check_keys(OmegaConf.to_container(dot), Config, "")
        layers.append(dot)
    try:
        merged = OmegaConf.merge(base, *layers)
        cfg = OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is missing: give an import path 'module:Class' or a registered name"
                          if e.full_key.endswith(".entry") else f"{e.full_key} is missing: set it") from e
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"invalid value for config key '{key}': {e.msg if hasattr(e, 'msg') else e}") from e
    assert isinstance(cfg, Config)
    return cfg


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; malformed YAML or another shape is one ConfigError naming the
    file and line (an empty file is an empty mapping)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        text = path.read_text()
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({what}); fix the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config ({e})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}:1: a config is a mapping of sections (job:, model:, algo: ...), "
                          f"not a {type(raw).__name__}")
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: not a valid config file: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def import_object(path: str) -> Any:
    """``module:attr`` -> the object, with a ConfigError naming the path on failure."""
    module, _, attr = path.partition(":")
    if not attr:
        raise ConfigError(f"{path!r} is not an import path of the form 'module:attr'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import {path!r}: {e}") from e
