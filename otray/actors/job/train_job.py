"""TrainJob: one training job (RL with an optional SFT warm-up, or SFT), assembled from parts.

- ``policies`` (:mod:`otray.actors.job.runtime`): each trained policy's learner and rollout
  fleet; the first is the job's own (env jobs and self-play have exactly one);
- ``source`` (:mod:`otray.actors.job.step`): where trajectory groups come from, the env
  mixture (:mod:`otray.actors.job.env_source`) or a game (:mod:`otray.actors.job.game_source`),
  behind a :class:`~otray.actors.job.step.Prefetcher` for the off-policy pipeline;
- ``sft`` (:mod:`otray.actors.job.sft`): supervised steps on the job's first policy;
- ``episodes`` (:class:`~otray.actors.job.episodes.EpisodeLog`): a few episodes per step.

The job owns the step counter and the files in its directory (``config.json``,
``metrics.jsonl``, ``trajectories.jsonl``, ``checkpoints/step-N``); nothing below it
calls back into it. ``otray.actors.job.run.run`` drives it step by step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otray import metric_keys as K
from otray.actors.job.env_source import EnvGroupSource, EnvRollouts
from otray.actors.job.episodes import EpisodeLog, load_splits
from otray.actors.job.runtime import ActorFactory, PolicyRuntime, ready_policies, start_policies
from otray.actors.job.sft import SFTTrainer
from otray.actors.job.step import GroupSource, Prefetcher, rl_step
from otray.timing import StepClock
from otray.config import Config, to_dict
from otray.models import is_vision_model, load_tokenizer, resolve_model_path
from otray.types import ModelLoadError


class TrainJob:
    """Bundle layout in a job's placement group: see :mod:`otray.actors.job.runtime`."""

    def __init__(self, cfg: Config, job_dir: str | Path, *, log: Callable[[str], None] = print,
                 placement_group: Any = None):
        self.cfg, self.log, self.dir = cfg, log, Path(job_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        cfg.algo.kl_coeff = resolve_kl_coeff(cfg, self.model_path)
        cfg.algo.vision_lr_scale = resolve_vision_lr_scale(cfg, self.model_path)
        (self.dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))  # as run: defaults resolved
        self.factory = factory = ActorFactory(cfg, self.model_path, placement_group, job_id=self.dir.name)
        starting = start_policies(cfg, factory)  # the actors import torch and load the model meanwhile
        try:
            self.tokenizer = load_tokenizer(self.model_path)
            self.env_splits = {name: load_splits(name, e.dataset, e.splits, cfg.job.seed, f"envs.{name}")
                               for name, e in cfg.envs.items()}
            # chat data: the whole of an SFT job, or an RL job's warm-up data when sft.splits.train is given
            chat = (load_splits("sft", cfg.sft.dataset, cfg.sft.splits, cfg.job.seed, "sft")
                    if "train" in cfg.sft.splits else {})
            self.policies: dict[str, PolicyRuntime] = ready_policies(cfg, starting)
        except BaseException:
            factory.close()  # a bad dataset or tokenizer: the started actors end with the error
            raise
        main = self.main
        if cfg.game is None:  # a game's coordinator holds its own worker handles (it routes around a dead one)
            for policy in self.policies.values():
                policy.replace_workers(factory, cfg.job.max_failures, mid_step=cfg.algo.max_steps_off_policy == 0)
        self.rollouts = (EnvRollouts(cfg, self.tokenizer, main.fleet.generate, main.info.max_model_len)
                         if main.fleet is not None and cfg.envs else None)
        self.source: GroupSource | None = None
        if cfg.game is not None and cfg.job.kind == "rl":  # an SFT job of a game config: its chat data only
            from otray.actors.job.game_source import GameGroupSource

            self.source = GameGroupSource(cfg, factory, self.tokenizer, main.info.max_model_len,
                                          {n: p.workers for n, p in self.policies.items()}, self.dir)
        elif cfg.job.kind == "rl":
            self.source = EnvGroupSource(cfg, self.rollouts, self.env_splits)
        self.pipeline = Prefetcher(self.source, cfg.algo.max_steps_off_policy) if self.source is not None else None
        self.sft = SFTTrainer(cfg, main, self.tokenizer, chat, self.env_splits, self.rollouts, log)
        self.episodes = EpisodeLog(self.dir)
        self.step = 0
        self.warmup_state: dict[str, Any] | None = None  # a resumed job's SFT warm-up progress, if it was midway
        # the eval row RL started from (after the warm-up, or before any training): saved with each checkpoint, so a
        # job resumed into another directory keeps its held-out guard and its change from the start
        self.rl_start: dict[str, Any] | None = None
        self.busy_prev: list[float] = []  # the first policy's actors' busy clocks at the end of the last step
        self.startup_s = time.perf_counter() - t0
        log(f"job ready in {self.startup_s:.1f}s: model {self.model_path}, backend {main.info.backend}, "
            f"{len(main.workers) if not main.colocated else 0} rollout worker(s)"
            + (" (generating in the learner: rollout.colocate)" if main.colocated else ""))

    @property
    def main(self) -> PolicyRuntime:
        """The job's own policy (the first trained one): SFT, checkpoints' top level, timing."""
        return next(iter(self.policies.values()))

    @property
    def first_rollout_at(self) -> float | None:
        """Wall clock (time.time) of the job's first rollout, for submit -> first rollout."""
        times = [getattr(s, "first_rollout_at", None) for s in (self.rollouts, self.source)]
        return min((t for t in times if t is not None), default=None)

    # ------------------------------------------------------------------ steps

    def rl_step(self) -> dict[str, Any]:
        """One RL step (``otray.actors.job.step.rl_step``) after a health check of every fleet (a dead rollout
        worker of an env job is replaced in its bundle, up to ``job.max_failures``)."""
        clock = StepClock()  # the health check is part of the step's time ("other")
        for policy in self.policies.values():
            for line in policy.check_health():
                self.log(f"  {line}")
        clock.mark("other")
        m = rl_step(self.pipeline, self.policies, self.cfg.algo, self.step, clock)
        self.step += 1
        self.episodes.add(self.step, m.shown, m.advantage_of)
        busy = self.main.busy_s()
        prev = self.busy_prev if len(self.busy_prev) == len(busy) else [0.0] * len(busy)
        delta, self.busy_prev = [max(0.0, b - p) for b, p in zip(busy, prev)], busy  # (a new worker starts at 0)
        m.clock.mark("other")
        replaced = {K.WORKERS_REPLACED: self.main.replaced} if self.main.replaced else {}
        healed = [line for p in self.policies.values() for line in p.take_healed()]
        if healed:
            replaced[K.RECOVERY_WORKERS] = "; ".join(healed)
        return {**m.row, **replaced,
                **m.clock.metrics(learner_busy_s=delta[0], rollout_busy_s=delta[1:], generate_s=m.generate_s)}

    def sft_step(self) -> dict[str, Any]:
        row = self.sft.step(self.step)
        self.step += 1
        return row

    def step_fn(self) -> Callable[[], dict[str, Any]]:
        """What one step of this job is: an SFT job's ``sft_step``, else ``rl_step``."""
        return self.sft_step if self.cfg.job.kind == "sft" else self.rl_step

    def anchor(self, keep: bool = False) -> None:
        """Every trained policy's learner takes its weights now as the policy RL starts from (``algo.kl_coeff``;
        ``keep``: a resumed learner keeps the one its checkpoint held)."""
        for name, policy in self.policies.items():
            if policy.anchor(keep):
                self.log(f"  policy {name!r}: KL reference taken at step {self.step} (algo.kl_coeff={self.cfg.algo.kl_coeff})")

    def evaluate(self) -> dict[str, float]:
        """Held-out figures: each env's eval split (or the game's evaluation games) with the current
        weights, and, with chat data, ``eval/sft_loss``."""
        out: dict[str, float] = {}
        if "eval" in self.sft.chat:
            out[K.EVAL_SFT_LOSS] = self.sft.heldout_loss()
        if self.main.fleet is None:
            return out
        for policy in self.policies.values():
            if not policy.synced:
                policy.sync_weights()
        if self.cfg.game is not None:
            out.update(self.source.evaluate(self.step, self.cfg.eval.greedy))
        elif self.rollouts is not None:
            out.update(self.rollouts.evaluate(self.env_splits, self.cfg.eval, self.step))
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, warmup: dict[str, Any] | None = None) -> str:
        """The first policy's learner state (+ job step and data position; ``warmup``: an SFT warm-up's
        progress, when it is saved midway) and exported model at the top, every other trained policy's
        under ``policies/<name>/``."""
        path = self.dir / "checkpoints" / f"step-{self.step:06d}"
        if self.league_due():  # the snapshot joins the pool first, so that this checkpoint's state holds it
            self.source.league.add(self.step, path, self.source.elo)
        first = {"job_step": self.step, "data": self.data_state(), **({"sft_warmup": warmup} if warmup else {}),
                 **({"rl_start": self.rl_start} if self.rl_start is not None and not warmup else {})}
        for k, (name, policy) in enumerate(self.policies.items()):
            policy.save(path if k == 0 else path / "policies" / name, first if k == 0 else {})
        self.log(f"  checkpoint: {path}")
        return str(path)

    def league_due(self) -> bool:
        """A league game job at a step that adds a snapshot (a checkpoint) to its pools."""
        league = getattr(self.source, "league", None)
        return league is not None and league.due(self.step)

    def resume(self, path: str) -> int:
        """Continue from a checkpoint: same step counter, same next batch, same weights."""
        if not (Path(path) / "state" / "meta.json").exists():
            raise ModelLoadError(f"checkpoint.resume_from={path!r} holds no learner state ({path}/state/meta.json); "
                                 "give a directory like <job dir>/checkpoints/step-000010")
        for k, (name, policy) in enumerate(self.policies.items()):
            meta = policy.load(Path(path) if k == 0 else Path(path) / "policies" / name)
            if k == 0:
                self.step = meta.extra_state["job_step"]
                self.load_data_state(meta.extra_state["data"])
                self.warmup_state = meta.extra_state.get("sft_warmup")  # saved midway through the warm-up
                self.rl_start = meta.extra_state.get("rl_start")
        self.log(f"resumed from {path} at step {self.step}")
        return self.step

    def data_state(self) -> dict[str, Any]:
        """Where the job is in its data: the env mixture or the next game seed, the chat train split."""
        state = dict(self.pipeline.state()) if self.pipeline is not None else {}
        if self.cfg.job.kind == "sft":
            state["sft_position"] = list(self.sft.chat["train"].position)
        return state

    def load_data_state(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state(state)
        if "sft_position" in state:
            self.sft.chat["train"].seek(tuple(state["sft_position"]))

    def close(self) -> None:
        """End the job's actors (learners, rollout workers, a game's coordinator)."""
        self.factory.close()

    def write_metrics(self, row: dict[str, Any]) -> None:
        with (self.dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """This job directory's ``metrics.jsonl`` rows (none when it has none yet)."""
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def rewind_metrics(self, step: int) -> None:
        """Drop the rows after ``step`` from this job directory's ``metrics.jsonl`` (a job restarted there
        from its checkpoint at ``step`` runs those steps again)."""
        path = self.dir / "metrics.jsonl"
        if path.exists():
            kept = [row for row in self.read_metrics()
                    if int(row.get("step", 0)) <= step or row.get(K.PHASE) == K.PHASE_RECOVERY]  # (events stay)
            path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def resolve_kl_coeff(cfg: Config, model_path: str) -> float:
    """``algo.kl_coeff`` as the job runs it: the config's, or when unset 1.0 on a vision-language model
    with one learner and 0 otherwise. Measured (issue 55, ``docs/notes/learning.md``): on untuned visual
    questions GRPO from the warm-up's policy lost held-out accuracy without the pull (80.0% -> 64.0%) and
    gained with it (80.0% -> 95.3%), the tiny VLM answering classes it cannot tell apart alike; on the text
    recipes it held without, and the pull halved the demo's gain (+26 -> +16 points). A sharded learner
    keeps no starting policy (0; the config check refuses a set coefficient there)."""
    if cfg.algo.kl_coeff is not None:
        return float(cfg.algo.kl_coeff)
    return 1.0 if cfg.resources.learner_workers <= 1 and is_vision_model(model_path) else 0.0


RL_VISION_FACTOR = 0.3  # unset algo.vision_lr_scale: this times the warm-up's rate for the tower


def resolve_vision_lr_scale(cfg: Config, model_path: str) -> float | None:
    """``algo.vision_lr_scale`` as the job runs it: None for a text model (nothing to scale; a set value is
    refused), else the config's, or when unset ``RL_VISION_FACTOR`` times the warm-up's (``model.vision_lr_scale``)
    where the warm-up gave the tower a group of its own (0 < scale < 1), the warm-up's elsewhere. Measured
    (issue 55, session 62, ``docs/notes/learning.md``): at the warm-up's 0.1 the tiny VLM's place question seed 1
    over 80 RL steps climbed to a sampled reward of 0.91 and then broke in one step carried by the tower (74% ->
    24% -> 52% held-out, the tower's gradient norm 0.1 -> 11 -> 385); held in RL (0) it went 74% -> 100%, but the
    shape-kind question gains through the tower (40 steps: seed 1 +7.3 -> -10.7); at 0.3x (0.03) the four
    questions at two seeds held 8/8 and gained 6/8 (the other two: colour, 99-100% after the warm-up), and
    count_shapes / shapes_times kept their gains (100 / 100%; 98 / 97% against 98 / 98%). A value other than the
    warm-up's needs the tower in an optimizer group of its own."""
    value = cfg.algo.vision_lr_scale
    if not is_vision_model(model_path):
        if value is not None:
            raise ValueError(f"algo.vision_lr_scale={value:g} is set, but {cfg.model.path!r} has no vision tower: "
                             "remove it (it applies to vision-language models only)")
        return None
    own = cfg.model.vision_lr_scale
    if value is None:
        return RL_VISION_FACTOR * own if 0 < own < 1 else float(own)
    if not 0 < own < 1 and float(value) != own:
        raise ValueError(f"algo.vision_lr_scale={value:g} needs the vision tower in a learning-rate group of its "
                         f"own, and model.vision_lr_scale={own:g} gives it none (0 freezes it, 1 trains it with the "
                         "language model): set model.vision_lr_scale between 0 and 1, or algo.vision_lr_scale to "
                         f"{own:g}")
    return float(value)
