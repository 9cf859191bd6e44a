"""Who plays a seat in a game: :class:`PolicySpec`, parsed once from the config's strings.

A game config maps every agent to a policy written as text (``game.policies``) and
names evaluation opponents the same way (``game.eval_opponents``):

- ``trained`` or ``trained:NAME``: a policy the job trains (``trained`` is ``trained:main``);
- ``frozen:REF``: a fixed model; REF is ``JOB_ID[:STEP]``, a checkpoint or a model directory;
- ``random``: a uniformly random legal move;
- ``scripted:module:fn``: ``fn(observation, agent) -> action``; ``scripted:module:fn(k=v, ...)``
  passes literal keyword arguments (``scripted:envs.gomoku:heuristic(random_prob=0.3)``). A
  function with a parameter named ``rng`` is also given a ``random.Random`` seeded by the game
  seed and move number, so its games replay exactly.

Everything past the config works with :class:`PolicySpec` values; ``str(spec)`` gives the
canonical text back (what the coordinator's policy library is keyed by).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from otray.types import ConfigError

KINDS = ("trained", "frozen", "random", "scripted")
_FUNCTION_CALL = re.compile(r"([\w.]+:[\w.]+)(?:\((.*)\))?", re.S)  # module:fn or module:fn(...)


@dataclass(frozen=True)
class PolicySpec:
    kind: str  # trained | frozen | random | scripted
    arg: str = ""  # trained: the policy's name; frozen: REF; scripted: module:fn; random: ""

    @classmethod
    def parse(cls, text: str, where: str = "game.policies") -> "PolicySpec":
        """``trained[:NAME]`` | ``frozen:REF`` | ``random`` | ``scripted:module:fn``; else a ConfigError naming ``where``."""
        kind, _, arg = str(text).strip().partition(":")
        if kind == "trained" and not arg:
            arg = "main"
        if kind not in KINDS or (kind == "random") != (arg == ""):
            raise ConfigError(f"{where}: {text!r} is not a policy; write trained[:NAME] | frozen:REF | random | "
                              "scripted:module:fn")
        spec = cls(kind, arg)
        if kind == "scripted":
            try:
                spec.call()
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
        return spec

    def call(self) -> tuple[str, dict[str, Any]]:
        """A scripted policy's import path and keyword arguments: ``m:fn(k=1)`` -> ``("m:fn", {"k": 1})``."""
        return function_call(self.arg, f"scripted policy {self.arg!r}")

    def __str__(self) -> str:
        return self.kind if self.kind == "random" else f"{self.kind}:{self.arg}"

    @property
    def label(self) -> str:
        """The spec as a metric-name part: ``scripted:envs.x:heuristic`` -> ``heuristic``, ``frozen:JOB_ID:7``
        -> ``frozen-JOB_ID-7``, ``frozen:/runs/a/checkpoints/step-000010`` -> ``frozen-step-000010``."""
        if self.kind == "frozen":
            return "frozen-" + (Path(self.arg.rstrip("/")).name if "/" in self.arg else self.arg.replace(":", "-"))
        if self.kind == "scripted":  # heuristic(random_prob=0.3) -> heuristic-random_prob-0.3
            path, kwargs = self.call()
            return "-".join([path.split(":")[-1], *(f"{k}-{v}" for k, v in kwargs.items())])
        return str(self).split(":")[-1]


def function_call(text: str, what: str) -> tuple[str, dict[str, Any]]:
    """``module:fn`` or ``module:fn(name=literal, ...)`` -> its import path and keyword arguments
    (``"m:fn(k=1)"`` -> ``("m:fn", {"k": 1})``); a ValueError that starts with ``what`` when it is neither.
    Scripted policies and ``game.move_reward`` are written this way."""
    found = _FUNCTION_CALL.fullmatch(str(text).strip())
    if found is None:
        raise ValueError(f"{what}: write module:fn or module:fn(name=value, ...)")
    kwargs: dict[str, Any] = {}
    if found.group(2) and found.group(2).strip():
        try:
            call = ast.parse(f"f({found.group(2)})", mode="eval").body
            if not isinstance(call, ast.Call) or call.args:
                raise ValueError("positional arguments")
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
        except (SyntaxError, ValueError) as e:
            raise ValueError(f"{what}: its arguments must be name=literal pairs (numbers, strings, booleans), "
                             f"e.g. heuristic(random_prob=0.3) ({e})") from None
    return found.group(1), kwargs


def bound_function(path: str, kwargs: dict[str, Any], what: str) -> Callable[..., Any]:
    """The function at ``path`` with ``kwargs`` bound (its first two parameters, observation and agent,
    left free); a ConfigError starting with ``what`` when it cannot be imported or does not take them."""
    import functools
    import inspect

    from otray.structured import import_object

    fn = import_object(path)
    try:
        inspect.signature(fn).bind_partial(None, None, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{what}: {path} does not take these arguments ({e})") from None
    return functools.partial(fn, **kwargs) if kwargs else fn


def scripted_function(spec: PolicySpec) -> Callable[..., Any]:
    """The function a ``scripted:`` spec names, its keyword arguments bound (:func:`bound_function`)."""
    return bound_function(*spec.call(), what=f"scripted policy {spec.arg!r}")


def move_reward_function(cfg: Any) -> Callable[..., Any] | None:
    """``game.move_reward`` (``module:fn(k=v)``, called as ``fn(observation, agent, action)``) imported with
    its arguments bound; None when the config sets none; a ConfigError naming the key when it is malformed."""
    if cfg.game is None or not cfg.game.move_reward:
        return None
    return bound_function(*move_reward_call(cfg), what="game.move_reward")


def move_reward_call(cfg: Any) -> tuple[str, dict[str, Any]]:
    """``game.move_reward`` parsed (:func:`function_call`) without importing it; a ConfigError naming the key."""
    try:
        return function_call(cfg.game.move_reward, f"game.move_reward: {cfg.game.move_reward!r}")
    except ValueError as e:
        raise ConfigError(str(e)) from None


# ------------------------------------------------------------------ a job config's policies (cfg: otray.config.Config)


def seating(cfg: Any) -> dict[str, PolicySpec]:
    """``game.policies`` parsed: agent -> PolicySpec."""
    return {} if cfg.game is None else {a: PolicySpec.parse(p, f"game.policies.{a}") for a, p in cfg.game.policies.items()}


def training_seatings(cfg: Any) -> list[dict[str, PolicySpec]]:
    """``game.seatings`` parsed (empty when the config gives none: ``policies`` and its rotations are played)."""
    if cfg.game is None:
        return []
    return [{a: PolicySpec.parse(p, f"game.seatings[{i}].{a}") for a, p in seats.items()}
            for i, seats in enumerate(cfg.game.seatings)]


def eval_opponents(cfg: Any) -> list[PolicySpec]:
    """``game.eval_opponents`` parsed."""
    return [] if cfg.game is None else [PolicySpec.parse(p, "game.eval_opponents") for p in cfg.game.eval_opponents]


def trained_policies(cfg: Any) -> list[str]:
    """Names of the policies the job trains, in the order they first appear (the first is the job's own);
    an env job trains one, ``main``."""
    if cfg.game is None:
        return ["main"]
    return list(dict.fromkeys(p.arg for p in seating(cfg).values() if p.kind == "trained"))


def league_fixed(cfg: Any) -> list[PolicySpec]:
    """``game.league.fixed`` parsed (empty when the league is off)."""
    if cfg.game is None or not league_on(cfg):
        return []
    return [PolicySpec.parse(p, "game.league.fixed") for p in cfg.game.league.fixed]


def league_on(cfg: Any) -> bool:
    """A training game job with ``game.league.every`` set (inference jobs play no league)."""
    return cfg.game is not None and cfg.job.kind != "infer" and cfg.game.league.every > 0


def frozen_policies(cfg: Any) -> list[PolicySpec]:
    """The game's ``frozen:REF`` policies (seats, eval opponents, the league's fixed opponents), each once."""
    seated = [p for seats in [seating(cfg), *training_seatings(cfg)] for p in seats.values()]
    return list(dict.fromkeys(p for p in [*seated, *eval_opponents(cfg), *league_fixed(cfg)] if p.kind == "frozen"))


def league_workers(cfg: Any) -> int:
    """Rollout workers (and bundles) for league snapshots: one per trained policy when the league is on."""
    return len(trained_policies(cfg)) if league_on(cfg) else 0


def learner_ranks(cfg: Any) -> int:
    """Learner actors per trained policy (bundles too): ``resources.learner_workers``; none lead an
    inference job, whose bundle 0 holds only its driver."""
    return 1 if cfg.job.kind == "infer" else cfg.resources.learner_workers


def policy_bundles(cfg: Any) -> int:
    """Bundles one trained policy takes in the job's placement group: its learner ranks, then its
    rollout workers (``otray.actors.control.lease.bundles_for``)."""
    return learner_ranks(cfg) + num_rollout_workers(cfg)


def num_rollout_workers(cfg: Any) -> int:
    """Rollout worker actors the job needs: none for an SFT job without envs to evaluate, and none when
    the learner generates (``rollout.colocate``)."""
    if cfg.job.kind == "infer":  # no learner to generate with
        return cfg.rollout.num_workers
    return 0 if (cfg.job.kind == "sft" and not cfg.envs) or cfg.rollout.colocate else cfg.rollout.num_workers
