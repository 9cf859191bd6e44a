"""Supervised training of one policy: the SFT warm-up of RL jobs and the steps of SFT jobs.

:class:`SFTTrainer` works on a :class:`~otray.actors.job.runtime.PolicyRuntime` (the job's
first policy) with token-mean cross-entropy. Its data is either chat conversations
(``sft.splits``: rows with a ``messages`` list; the loss covers assistant turns) or, for
a warm-up without chat data, the env's own tasks (the env's first observation as the
prompt, ``sft.completion_field`` as the reply). A warm-up may stop early on greedy
accuracy over a fixed sample of *training* tasks (``sft.stop_at_accuracy``), measured
through the job's :class:`~otray.actors.job.env_source.EnvRollouts`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from otray import metric_keys as K
from otray.actors.job.episodes import batch_digest
from otray.actors.job.env_source import EnvRollouts
from otray.actors.job.runtime import SUPERVISED, PolicyRuntime
from otray.algos.datums import chat_datum, sft_datum
from otray.config import Config
from otray.env import TaskSource, resolve
from otray.models import end_of_turn_ids
from otray.types import DatasetError, Datum, Task
from otray.vlm import observation_prompt


class SFTTrainer:
    def __init__(self, cfg: Config, policy: PolicyRuntime, tokenizer: Any, chat: dict[str, TaskSource],
                 env_splits: dict[str, dict[str, TaskSource]], rollouts: EnvRollouts | None,
                 log: Callable[[str], None] = print):
        self.cfg, self.policy, self.tokenizer, self.log = cfg, policy, tokenizer, log
        self.chat, self.env_splits, self.rollouts = chat, env_splits, rollouts

    # ------------------------------------------------------------------ batches

    def env_batch(self, tasks: list[Task]) -> list[Datum]:
        """Datums of env tasks: the env's first observation as prompt, ``completion_field`` + end of turn."""
        cfg, tok = self.cfg, self.tokenizer
        eot = end_of_turn_ids(tok)[-1] if tok.eos_token_id is None else tok.eos_token_id
        datums = []
        for task in tasks:
            env = resolve(cfg.envs[task.env].entry)(**cfg.envs[task.env].kwargs)
            first, _ = env.reset(task, seed=cfg.job.seed)
            msgs = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else [])
            prompt, images = observation_prompt(tok, msgs, first)  # an image observation: its image tokens
            completion = tok.encode(str(task.data[cfg.sft.completion_field]), add_special_tokens=False)
            datums.append(sft_datum(prompt, completion + [eot], images))
        return datums

    def chat_batch(self, tasks: list[Task]) -> list[Datum]:
        """Datums of chat rows (``sft.messages_field``), each checked to fit the model's context."""
        field, limit = self.cfg.sft.messages_field, self.policy.info.max_model_len
        datums = []
        for task in tasks:
            if field not in task.data:
                raise DatasetError(f"SFT row {task.id!r} has no {field!r} field (sft.messages_field); "
                                   f"its fields: {', '.join(task.data)}")
            try:
                datum = chat_datum(self.tokenizer, task.data[field])
            except DatasetError as e:
                raise DatasetError(f"SFT row {task.id!r}: {e}") from None
            if len(datum.input_ids) + 1 > limit:
                raise DatasetError(f"SFT row {task.id!r} has {len(datum.input_ids) + 1} tokens, more than "
                                   f"rollout.max_model_len={limit}; shorten it or raise the limit")
            datums.append(datum)
        return datums

    # ------------------------------------------------------------------ updates

    def lr(self, step: int) -> float:
        """Linear warm-up over ``sft.warmup_steps``, then constant."""
        return self.cfg.sft.learning_rate * min(1.0, step / max(1, self.cfg.sft.warmup_steps))

    def update(self, datums: list[Datum], step: int) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy at the learning rate of ``step`` (1-based)."""
        return self.policy.update(datums, SUPERVISED, self.cfg.algo, self.lr(step))

    def step(self, done: int) -> dict[str, Any]:
        """Step ``done + 1`` of an SFT job: a batch of chat conversations, cross-entropy on assistant turns."""
        t0 = time.perf_counter()
        tasks = self.chat["train"].sample(self.cfg.sft.batch_size)
        datums = self.chat_batch(tasks)
        out = self.update(datums, done + 1)
        return {"step": done + 1, "batch": batch_digest(tasks), "loss": out["loss"],
                "trained_tokens": sum(sum(d.mask) for d in datums), "lr": self.lr(done + 1),
                K.STEP_S: time.perf_counter() - t0, **{f"learner/{k}": v for k, v in out.items()}}

    def heldout_loss(self) -> float:
        """Token-mean cross-entropy of the SFT eval split (``sft.eval_samples`` rows)."""
        import ray

        datums = self.chat_batch(self.chat["eval"].tasks[: self.cfg.sft.eval_samples])
        logprobs = ray.get(self.policy.learner.forward.remote(datums))
        total = sum(-lp * m for d, lps in zip(datums, logprobs) for lp, m in zip(lps, d.mask))
        return total / max(1.0, sum(sum(d.mask) for d in datums))

    def warmup(self, resume: dict[str, Any] | None = None,
               save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, float]:
        """An RL job's warm-up: up to ``sft.steps`` steps on chat data or the env's tasks, stopping once
        greedy accuracy on a fixed sample of training tasks reaches ``sft.stop_at_accuracy``. ``save(state)``
        (a job that heals by restarts) checkpoints it at each accuracy check; ``resume``: such a state,
        to go on from (the learner's weights and optimizer already loaded)."""
        sft = self.cfg.sft
        source = probe = None
        if self.cfg.envs:  # a game job warms up on chat data only, without the accuracy check
            env_name = sft.env or next(iter(self.cfg.envs))
            source = TaskSource(self.env_splits[env_name]["train"].tasks, seed=self.cfg.job.seed + 1)
            probe = source.tasks[: sft.check_samples]  # fixed training tasks for the early stop
        data = self.chat["train"] if self.chat else source
        t0, losses, train_acc, first = time.perf_counter(), [], None, 1
        if resume:
            first, losses, train_acc = resume["steps"] + 1, list(resume["losses"]), resume["train_accuracy"]
            data.seek(tuple(resume["position"]))
            t0 -= resume["seconds"]
        steps = first - 1
        for steps in range(first, sft.steps + 1):
            batch = (self.chat_batch(data.sample(sft.batch_size)) if self.chat  # chat demonstrations
                     else self.env_batch(data.sample(sft.batch_size)))  # the env's prompts + completion_field
            losses.append(self.update(batch, steps)["loss"])
            if sft.stop_at_accuracy is not None and probe and self.rollouts is not None and steps % sft.check_every == 0:
                self.policy.sync_weights()
                train_acc = self.rollouts.accuracy(probe, seed_step=0)
                self.log(f"  sft {steps}/{sft.steps}: loss {statistics.fmean(losses[-20:]):.3f}, "
                         f"train accuracy {train_acc:.3f}")
                if train_acc >= sft.stop_at_accuracy:
                    break
                if save is not None:
                    save({"steps": steps, "losses": losses[-20:], "train_accuracy": train_acc,
                          "position": list(data.position), "seconds": time.perf_counter() - t0})
            elif steps % max(1, sft.steps // 5) == 0:
                self.log(f"  sft {steps}/{sft.steps}: loss {statistics.fmean(losses[-20:]):.3f}")
        self.policy.sync_weights()
        return {"sft_steps": steps, "sft_loss": statistics.fmean(losses[-20:]) if losses else 0.0,
                "sft_train_accuracy": train_acc, "sft_s": time.perf_counter() - t0}
