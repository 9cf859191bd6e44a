"""Who plays a seat in a game: :class:`PolicySpec`, parsed once from the config's strings.

A game config maps every agent to a policy written as text (``game.policies``) and
names evaluation opponents the same way (``game.eval_opponents``):

- ``trained`` or ``trained:NAME``: a policy the job trains (``trained`` is ``trained:main``);
- ``frozen:REF``: a fixed model; REF is ``JOB_ID[:STEP]``, a checkpoint or a model directory;
- ``random``: a uniformly random legal move;
- ``scripted:module:fn``: ``fn(observation, agent) -> action``.

Everything past the config works with :class:`PolicySpec` values; ``str(spec)`` gives the
canonical text back (what the coordinator's policy library is keyed by).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otray.types import ConfigError

KINDS = ("trained", "frozen", "random", "scripted")


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
        return cls(kind, arg)

    def __str__(self) -> str:
        return self.kind if self.kind == "random" else f"{self.kind}:{self.arg}"

    @property
    def label(self) -> str:
        """The spec as a metric-name part: ``scripted:envs.x:heuristic`` -> ``heuristic``, ``frozen:JOB_ID:7``
        -> ``frozen-JOB_ID-7``, ``frozen:/runs/a/checkpoints/step-000010`` -> ``frozen-step-000010``."""
        if self.kind == "frozen":
            return "frozen-" + (Path(self.arg.rstrip("/")).name if "/" in self.arg else self.arg.replace(":", "-"))
        return str(self).split(":")[-1]


# ------------------------------------------------------------------ a job config's policies (cfg: otray.config.Config)


def seating(cfg: Any) -> dict[str, PolicySpec]:
    """``game.policies`` parsed: agent -> PolicySpec."""
    return {} if cfg.game is None else {a: PolicySpec.parse(p, f"game.policies.{a}") for a, p in cfg.game.policies.items()}


def eval_opponents(cfg: Any) -> list[PolicySpec]:
    """``game.eval_opponents`` parsed."""
    return [] if cfg.game is None else [PolicySpec.parse(p, "game.eval_opponents") for p in cfg.game.eval_opponents]


def trained_policies(cfg: Any) -> list[str]:
    """Names of the policies the job trains, in the order they first appear (the first is the job's own);
    an env job trains one, ``main``."""
    if cfg.game is None:
        return ["main"]
    return list(dict.fromkeys(p.arg for p in seating(cfg).values() if p.kind == "trained"))


def frozen_policies(cfg: Any) -> list[PolicySpec]:
    """The game's ``frozen:REF`` policies (seats and eval opponents), each once."""
    return list(dict.fromkeys(p for p in [*seating(cfg).values(), *eval_opponents(cfg)] if p.kind == "frozen"))


def learner_ranks(cfg: Any) -> int:
    """Learner actors per trained policy (bundles too): ``resources.learner_workers``; none lead an
    inference job, whose bundle 0 holds only its driver."""
    return 1 if cfg.job.kind == "infer" else cfg.resources.learner_workers


def policy_bundles(cfg: Any) -> int:
    """Bundles one trained policy takes in the job's placement group: its learner ranks, then its
    rollout workers (``otray.actors.lease.bundles_for``)."""
    return learner_ranks(cfg) + num_rollout_workers(cfg)


def num_rollout_workers(cfg: Any) -> int:
    """Rollout worker actors the job needs: none for an SFT job without envs to evaluate, and none when
    the learner generates (``rollout.colocate``)."""
    if cfg.job.kind == "infer":  # no learner to generate with
        return cfg.rollout.num_workers
    return 0 if (cfg.job.kind == "sft" and not cfg.envs) or cfg.rollout.colocate else cfg.rollout.num_workers
