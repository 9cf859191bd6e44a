"""Running one job to the end: ``run(cfg, job_dir)``, what the JobDriver actor and ``python -m otray.train`` call.

Prints a per-step table (step, mean reward or SFT loss, held-out accuracy, tokens/s,
step time) and writes the same rows to ``<job dir>/metrics.jsonl``, plus
``summary.json`` with the held-out figure at the start of the main phase (after
the SFT warm-up, if any) and at the end: accuracy when envs are evaluated, else the
SFT held-out loss. Inference jobs (``job.kind: infer``) go to ``otray.actors.job.inference.run_job``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otray import metric_keys as K
from otray.actors.job.heldout import HeldoutWatch
from otray.actors.job.train_job import TrainJob
from otray.config import Config

HEADER = f"{'step':>5} {'phase':<6} {'reward':>7} {'heldout':>8} {'tok/s':>8} {'step_s':>7}"


def table_row(row: dict[str, Any]) -> str:
    """One table line; SFT rows show the loss under 'reward' and the held-out loss when no accuracy exists.
    A row with the held-out guard's warning (:mod:`otray.actors.job.heldout`) gets it on a second line."""
    acc, reward = K.headline_eval(row), K.headline_reward(row)
    line = (f"{row[K.STEP]:>5} {row[K.PHASE]:<6} {'' if reward is None else f'{reward:.3f}':>7} "
            f"{'' if acc is None else f'{acc:.3f}':>8} {row.get(K.TOKENS_PER_S, 0.0):>8.0f} "
            f"{row.get(K.STEP_S, 0.0):>7.2f}")
    return line + (f"\nWARNING: {row[K.EVAL_WARNING]}" if K.EVAL_WARNING in row else "")


def run(cfg: Config, job_dir: Path, *, placement_group: Any = None,
        report: Callable[[dict[str, Any]], Any] | None = None,
        on_checkpoint: Callable[[int, str], Any] | None = None,
        on_episodes: Callable[[list[dict[str, Any]]], Any] | None = None,
        on_outputs: Callable[[list[dict[str, Any]]], Any] | None = None) -> dict[str, Any]:
    """Run one job; ``report`` receives every metrics row, ``on_checkpoint`` every (step, path),
    ``on_episodes`` the sampled episodes the job logged since the last row, ``on_outputs`` an
    inference job's output rows."""
    if cfg.job.kind == "infer":
        from otray.actors.job.inference import run_job

        return run_job(cfg, job_dir, placement_group=placement_group, report=report, on_episodes=on_episodes,
                       on_outputs=on_outputs)

    job = TrainJob(cfg, job_dir, placement_group=placement_group)
    try:
        return _train(cfg, job, job_dir, report, on_checkpoint, on_episodes)
    finally:
        job.close()


def _train(cfg: Config, job: TrainJob, job_dir: Path, report: Callable[[dict[str, Any]], Any] | None,
           on_checkpoint: Callable[[int, str], Any] | None,
           on_episodes: Callable[[list[dict[str, Any]]], Any] | None) -> dict[str, Any]:
    """The steps of :func:`run` for a training job, from the first evaluation to ``summary.json``."""
    from otray.metrics_sinks import MetricSinks

    sinks = MetricSinks(cfg, job_dir, job_dir.name)
    summary: dict[str, Any] = {"startup_s": job.startup_s, "backend": job.main.info.backend, "nodes": job.main.nodes}

    def emit(row: dict[str, Any]) -> None:
        job.write_metrics(row)
        sinks.log(row)
        print(table_row(row), flush=True)
        if report is not None:
            report(row)
        episodes = job.episodes.take()
        if on_episodes is not None and episodes:
            on_episodes(episodes)

    def save(warmup: dict[str, Any] | None = None) -> None:
        summary["last_checkpoint"] = job.save_checkpoint(warmup)
        if on_checkpoint is not None:
            on_checkpoint(job.step, summary["last_checkpoint"])

    t_start = time.perf_counter()
    print(HEADER, flush=True)
    ck, sft_job = cfg.checkpoint, cfg.job.kind == "sft"
    # a job that heals by restarts (job.max_failures, with checkpoints) also checkpoints its SFT warm-up, at
    # each accuracy check and when it ends: a restart goes on from there, not from before the warm-up
    healing = bool(ck.save_every and cfg.job.max_failures)
    watch: HeldoutWatch | None = None  # RL losing held-out accuracy it started with
    kl = float(cfg.algo.kl_coeff or 0.0)  # (resolved by the TrainJob: the warning's advice names it)

    def started(row: dict[str, Any]) -> None:  # the eval row RL starts from (kept in later checkpoints)
        nonlocal watch
        job.rl_start = row
        summary["heldout_start"], watch = K.headline_eval(row), HeldoutWatch.of(row, kl) if not sft_job else None

    def warm_up(resume: dict[str, Any] | None) -> None:
        row = {K.STEP: 0, K.PHASE: K.PHASE_SFT, **job.sft.warmup(resume, save if healing else None), **job.evaluate()}
        emit(row)
        started(row)
        if healing:
            save()

    if ck.resume_from:
        job.rewind_metrics(job.resume(ck.resume_from))  # (restarted in its own directory: no duplicate rows)
        rows = job.read_metrics()
        if job.rl_start is not None:  # (none in a checkpoint saved midway through the warm-up: it goes on below)
            if not any(r.get(K.PHASE) in (K.PHASE_SFT, K.PHASE_INIT) for r in rows):
                emit(job.rl_start)  # resumed into another directory: the start row comes with the checkpoint
                rows.append(job.rl_start)
            summary["heldout_start"] = K.headline_eval(job.rl_start)
        watch = HeldoutWatch.replay(rows, kl) if not sft_job else None
        if job.warmup_state is not None:  # saved midway through its SFT warm-up: it goes on with it
            warm_up(job.warmup_state)
    elif cfg.sft.steps and not sft_job:
        emit({K.STEP: 0, K.PHASE: K.PHASE_BASE, **job.evaluate()})
        warm_up(None)
    else:
        row = {K.STEP: 0, K.PHASE: K.PHASE_INIT, **job.evaluate()}
        emit(row)
        started(row)
    if kl and not sft_job:  # RL's reference: the policy as RL starts (a resumed job's own, if saved)
        job.anchor(keep=bool(ck.resume_from) and job.warmup_state is None)
    steps, step_fn = (cfg.sft.steps if sft_job else cfg.algo.steps), job.step_fn()
    phase = K.PHASE_SFT if sft_job else K.PHASE_GRPO
    while job.step < steps:
        t_step = time.perf_counter()
        metrics = step_fn()
        metrics[K.STEP_WALL_S] = time.perf_counter() - t_step  # as the caller saw it (the parts should sum to it)
        healed = metrics.pop(K.RECOVERY_WORKERS, None)  # rollout workers replaced in the step: an event row of its own
        if healed:  # (kept when a restart rewinds the step's rows: `otray status` lists it)
            emit({K.STEP: job.step, K.PHASE: K.PHASE_RECOVERY, K.RECOVERY_WORKERS: healed})
        last = job.step == steps
        if last or (cfg.eval.every and job.step % cfg.eval.every == 0):
            metrics.update(job.evaluate())
            metrics.update(watch.see(metrics) if watch is not None else {})
        emit({K.PHASE: phase, **metrics})
        if (ck.save_every and job.step % ck.save_every == 0) or (last and ck.save_at_end) or job.league_due():
            save()
        if last:
            summary["heldout_end"] = K.headline_eval(metrics)
    if steps == 0 and ck.save_at_end and not ck.resume_from:  # an SFT warm-up only: keep its result
        save()
    summary["total_s"] = time.perf_counter() - t_start
    summary["first_rollout_at"] = job.first_rollout_at
    if summary.get("heldout_end") is not None and summary.get("heldout_start") is not None:
        summary["heldout_change"] = summary["heldout_end"] - summary["heldout_start"]
    (job_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    sinks.close()
    return summary
