"""A job config's cross-field checks, run by ``otray.config.load`` after the range table
(``otray.ranges``): names a field may take, and fields that must agree with each other (colocation and
off-policy, sharded learners and GPUs, an SFT job's data, a game's seats). Each failure is a
ConfigError naming the keys and what to set instead.
"""

from __future__ import annotations

from typing import Any

from otray.device import DEVICES, DTYPES
from otray.names import ADVANTAGE_NAMES, AGGREGATIONS, loss_config
from otray.policies import eval_opponents, move_reward_call, seating, trained_policies, training_seatings
from otray.structured import one_of
from otray.types import ConfigError

REWARD_REDUCTIONS = ("sum", "mean", "max", "min")  # envs.X.reward_reduction: how turn rewards make an episode's


def check_values(cfg: Any) -> None:
    """The checks one field's range cannot express on an ``otray.config.Config`` (this module sits below
    it, so it takes the config untyped): names, and fields that must agree with each other."""
    one_of(cfg.job.kind, ("rl", "sft", "infer"), "job.kind")
    one_of(cfg.rollout.backend, ("auto", "vllm", "hf"), "rollout.backend")
    one_of(cfg.rollout.weight_sync, ("auto", "object_store", "shm", "cuda_ipc", "broadcast"), "rollout.weight_sync")
    if cfg.rollout.weight_sync in ("cuda_ipc", "broadcast") and cfg.resources.learner_workers > 1:
        raise ConfigError(f"rollout.weight_sync={cfg.rollout.weight_sync} sends from one learner's device buffer; a "
                          "sharded learner (resources.learner_workers > 1) gathers its weights on rank 0's host: "
                          "set rollout.weight_sync to auto, shm or object_store")
    one_of(cfg.rollout.sampler, ("auto", "eager", "compiled"), "rollout.sampler")
    if cfg.rollout.backend == "vllm" and cfg.rollout.sampler != "auto":
        raise ConfigError(f"rollout.sampler={cfg.rollout.sampler!r} is the HF backend's choice; vLLM compiles its "
                          "own (rollout.enforce_eager): set rollout.sampler to auto or rollout.backend to hf")
    one_of(cfg.model.device, DEVICES, "model.device")
    one_of(cfg.model.dtype, DTYPES, "model.dtype")
    one_of(cfg.logging.wandb_mode, ("offline", "online"), "logging.wandb_mode")
    one_of(cfg.algo.advantage, ADVANTAGE_NAMES, "algo.advantage")
    one_of(cfg.algo.aggregation, AGGREGATIONS, "algo.aggregation")
    loss_config(cfg.algo.loss_fn, **cfg.algo.loss_fn_config)
    one_of(cfg.algo.lr_schedule, ("constant", "linear", "cosine"), "algo.lr_schedule")
    if cfg.algo.kl_coeff and cfg.resources.learner_workers > 1:
        raise ConfigError(f"algo.kl_coeff={cfg.algo.kl_coeff} keeps the starting policy's weights beside the "
                          "trained ones in one learner; a sharded learner (resources.learner_workers > 1) does "
                          "not: set algo.kl_coeff to 0 or resources.learner_workers to 1")
    one_of(cfg.resources.strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), "resources.strategy")
    if cfg.algo.max_steps_off_policy and cfg.algo.loss_fn == "cross_entropy":
        raise ConfigError("algo.max_steps_off_policy=1 needs a loss that corrects for the sampler "
                          "(ppo, cispo, gspo, stable_reinforce, importance_sampling or dro), not 'cross_entropy'")
    if cfg.rollout.colocate:
        if cfg.rollout.backend not in ("auto", "hf"):
            raise ConfigError(f"rollout.colocate=true generates with the learner's own model (the HF backend); "
                              f"set rollout.backend to hf (got {cfg.rollout.backend!r}) or colocate to false")
        if cfg.algo.max_steps_off_policy:
            raise ConfigError("rollout.colocate=true runs generation and training in one actor, one after the "
                              "other: algo.max_steps_off_policy must be 0")
    res = cfg.resources
    if res.learner_workers > 1 and 0 < res.learner_gpus < 1:
        raise ConfigError(f"resources.learner_workers={res.learner_workers} with learner_gpus={res.learner_gpus}: "
                          "NCCL refuses two ranks on one GPU, so each rank needs a whole GPU (learner_gpus: 1), "
                          "or set learner_gpus: 0 to shard over CPU ranks (gloo)")
    if cfg.resources.learner_workers > 1 and cfg.rollout.colocate:
        raise ConfigError("rollout.colocate=true samples with the learner's own model, which a sharded learner "
                          "(resources.learner_workers > 1) does not hold whole: set one of them back")
    if cfg.job.kind == "infer":
        if cfg.game is not None and len(trained_policies(cfg)) > 1:
            raise ConfigError("an inference job plays one model: give a game config with one trained policy")
        for name, env in cfg.envs.items():
            if cfg.infer.split not in env.splits:
                raise ConfigError(f"envs.{name} has no {cfg.infer.split!r} split (it has: "
                                  f"{', '.join(env.splits) or 'none'}); pick one with --split / infer.split")
    if cfg.job.kind == "sft":
        if cfg.sft.steps < 1:
            raise ConfigError("job.kind=sft needs sft.steps >= 1")
        if "train" not in cfg.sft.splits:
            raise ConfigError("job.kind=sft needs sft.splits.train (a chat dataset: rows with a 'messages' list); "
                              "give sft.splits.train.path or sft.dataset.builder")
    elif cfg.game is not None:
        if cfg.envs:
            raise ConfigError("a job trains on 'envs' or on one 'game', not both (yet): remove one of them")
        for key in ("entry", "text"):
            if getattr(cfg.game, key) == "???":
                raise ConfigError(f"game.{key} is missing: give an import path 'module:attr'")
        one_of(cfg.game.on_exhausted, ("random", "forfeit"), "game.on_exhausted")
        one_of(cfg.game.context, ("game", "turn"), "game.context")
        one_of(cfg.game.openings, ("random", "played"), "game.openings")
        if cfg.game.move_reward:
            move_reward_call(cfg)
        if cfg.game.discount != 1.0 and cfg.game.context != "turn":
            raise ConfigError(f"game.discount={cfg.game.discount} splits a game's reward over its decisions, which "
                              "only game.context=turn makes separate trajectories: set context: turn, or discount: 1")
        if cfg.game.max_turns is not None and cfg.game.max_turns < 1:
            raise ConfigError(f"game.max_turns={cfg.game.max_turns}: give the moves after which an unfinished "
                              "game is a timeout (>= 1), or leave it out for no limit")
        check_league(cfg)
        check_seatings(cfg)
        if cfg.game.elo_k <= 0:
            raise ConfigError(f"game.elo_k={cfg.game.elo_k} must be positive (16 is usual)")
        if not any(p.kind == "trained" for p in seating(cfg).values()):
            raise ConfigError(f"game.policies must map agents to trained[:NAME] | frozen:REF | random | "
                              f"scripted:module:fn, with at least one trained agent; got {dict(cfg.game.policies)}")
        bad = [str(p) for p in eval_opponents(cfg) if p.kind == "trained"]
        if bad:
            raise ConfigError(f"game.eval_opponents takes random | scripted:module:fn | frozen:REF; got {bad}")
        if cfg.sft.steps > 0 and "train" not in cfg.sft.splits:
            raise ConfigError("a game job's SFT warm-up needs chat demonstrations: give sft.splits.train (e.g. "
                              "sft.dataset.builder: envs.tictactoe_text:make_chat_dataset) or set sft.steps=0")
        if "train" in cfg.sft.splits and len(trained_policies(cfg)) > 1:
            raise ConfigError("an SFT warm-up trains the job's first policy only; with several trained policies "
                              f"({', '.join(trained_policies(cfg))}) drop sft.splits.train or train one policy")
        if cfg.sft.stop_at_accuracy is not None:
            raise ConfigError("sft.stop_at_accuracy needs an env to measure accuracy on; a game job's SFT warm-up "
                              "runs sft.steps steps: remove sft.stop_at_accuracy")
    elif not cfg.envs:
        raise ConfigError("the config defines no environment: add at least one entry under 'envs' (or a 'game')")
    for name, env in cfg.envs.items():
        if env.entry == "???":
            raise ConfigError(f"envs.{name}.entry is missing: give an import path 'module:Class' or a registered name")
        one_of(env.reward_reduction, REWARD_REDUCTIONS, f"envs.{name}.reward_reduction")
        if env.num_rollouts < 1:
            raise ConfigError(f"envs.{name}.num_rollouts must be >= 1, got {env.num_rollouts}")
        one_of(env.group_reward, ("none", "replace", "add"), f"envs.{name}.group_reward")
        for key, value, low in (("max_concurrency", env.max_concurrency, 1), ("max_rollout_retries", env.max_rollout_retries, 0),
                                ("max_failing_rollouts", env.max_failing_rollouts, 0)):
            if value < low:
                raise ConfigError(f"envs.{name}.{key} must be >= {low}, got {value}")
        for key in ("timeout_s", "episode_timeout_s"):
            if getattr(env, key) is not None and getattr(env, key) <= 0:
                raise ConfigError(f"envs.{name}.{key} must be > 0 seconds (or null for no limit), got {getattr(env, key)}")
        if any(not s for s in env.stop):
            raise ConfigError(f"envs.{name}.stop holds an empty string; give non-empty stop strings")
        if cfg.job.kind == "rl" and "train" not in env.splits:
            raise ConfigError(f"envs.{name}.splits has no 'train' split for RL to sample from "
                              f"(it has: {', '.join(env.splits) or 'none'}); add envs.{name}.splits.train")
    if cfg.sft.steps and cfg.sft.env is not None and cfg.sft.env not in cfg.envs:
        raise ConfigError(f"sft.env={cfg.sft.env!r} names no env; defined envs: {', '.join(cfg.envs)}")


def check_seatings(cfg: Any) -> None:
    """``game.seatings``: each names the agents of ``game.policies``, trains one of its trained policies,
    and is not combined with ``rotate_seats`` (list the rotations you want instead)."""
    if not cfg.game.seatings:
        return
    if cfg.game.rotate_seats:
        raise ConfigError("game.seatings lists the training seatings itself: set game.rotate_seats=false (list "
                          "each rotation you want as a seating)")
    trained = set(trained_policies(cfg))
    for i, seats in enumerate(training_seatings(cfg)):
        if set(seats) != set(cfg.game.policies):
            raise ConfigError(f"game.seatings[{i}] must name the agents of game.policies {sorted(cfg.game.policies)}; "
                              f"got {sorted(seats)}")
        mine = {p.arg for p in seats.values() if p.kind == "trained"}
        if not mine or not mine <= trained:
            raise ConfigError(f"game.seatings[{i}] must seat at least one trained policy, and only those of "
                              f"game.policies ({', '.join(sorted(trained))}); got {dict(cfg.game.seatings[i])}")


def check_league(cfg: Any) -> None:
    """``game.league``: sizes and shares in range, fixed opponents that are not trained policies."""
    from otray.policies import PolicySpec

    lg = cfg.game.league
    if lg.every < 0 or lg.max_size < 1:
        raise ConfigError(f"game.league: every={lg.every} (0 = off, K = a snapshot every K steps) and "
                          f"max_size={lg.max_size} (>= 1) are out of range")
    one_of(lg.priority, ("hard", "uniform"), "game.league.priority")
    for key in ("share", "fixed_share"):
        if not 0.0 <= getattr(lg, key) <= 1.0:
            raise ConfigError(f"game.league.{key}={getattr(lg, key)} is a share: give a number in [0, 1]")
    bad = [p for p in lg.fixed if PolicySpec.parse(p, "game.league.fixed").kind == "trained"]
    if bad:
        raise ConfigError(f"game.league.fixed takes random | scripted:module:fn | frozen:REF; got {bad}")
