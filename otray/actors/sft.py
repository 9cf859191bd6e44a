"""Supervised training inside a TrainJob: the SFT warm-up of RL jobs and the steps of SFT jobs.

A mixin of :class:`otray.actors.job.TrainJob` (it uses the job's learner, tokenizer,
envs, chat splits and ``sync_weights``/``accuracy``), kept apart because SFT and the
RL step are two ideas.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from otray.algos.datums import chat_datum, sft_datum
from otray.env import TaskSource, resolve
from otray.models import chat_prompt_ids, end_of_turn_ids
from otray.types import DatasetError, Task


def batch_digest(tasks: list[Task]) -> str:
    """A short fingerprint of a batch's task ids, to check that a resumed run draws the same data."""
    import hashlib

    return hashlib.sha1("\n".join(f"{t.env}/{t.id}" for t in tasks).encode()).hexdigest()[:12]


class SFTMixin:
    def sft_batch(self, tasks: list[Task]) -> list:
        sft = self.cfg.sft
        eot = end_of_turn_ids(self.tokenizer)[-1] if self.tokenizer.eos_token_id is None else self.tokenizer.eos_token_id
        datums = []
        for task in tasks:
            env = resolve(self.cfg.envs[task.env].entry)(**self.cfg.envs[task.env].kwargs)
            first, _ = env.reset(task, seed=self.cfg.job.seed)
            msgs = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else [])
            prompt = chat_prompt_ids(self.tokenizer, msgs + [{"role": "user", "content": first}])
            completion = self.tokenizer.encode(str(task.data[sft.completion_field]), add_special_tokens=False)
            datums.append(sft_datum(prompt, completion + [eot]))
        return datums

    def chat_batch(self, tasks: list[Task]) -> list:
        """Datums of chat rows (``sft.messages_field``), each checked to fit the model's context."""
        field, limit = self.cfg.sft.messages_field, self.worker_info["max_model_len"]
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

    def sft_update(self, datums: list, lr: float) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on ``datums``."""
        import ray

        fb = ray.get(self.learner.forward_backward.remote(datums, "cross_entropy", {}, "token_mean"))
        opt = ray.get(self.learner.optim_step.remote(lr, tuple(self.cfg.algo.betas), 1e-8,
                                                      self.cfg.algo.weight_decay, self.cfg.algo.grad_clip))
        self.weights_synced = False
        self.learner_version += 1  # what rl_step's policy_lag counts from
        return {**fb, **opt}

    def sft_lr(self, step: int) -> float:
        """Linear warm-up over ``sft.warmup_steps``, then constant."""
        return self.cfg.sft.learning_rate * min(1.0, step / max(1, self.cfg.sft.warmup_steps))

    def sft_step(self) -> dict[str, Any]:
        """One step of an SFT job: a batch of chat conversations, cross-entropy on assistant turns."""
        t0 = time.perf_counter()
        tasks = self.chat["train"].sample(self.cfg.sft.batch_size)
        datums = self.chat_batch(tasks)
        out = self.sft_update(datums, self.sft_lr(self.step + 1))
        self.step += 1
        return {"step": self.step, "batch": batch_digest(tasks), "loss": out["loss"],
                "trained_tokens": sum(sum(d.mask) for d in datums), "lr": self.sft_lr(self.step),
                "step_s": time.perf_counter() - t0, **{f"learner/{k}": v for k, v in out.items()}}

    def heldout_loss(self) -> float:
        """Token-mean cross-entropy of the SFT eval split (``sft.eval_samples`` rows)."""
        import ray

        datums = self.chat_batch(self.chat["eval"].tasks[: self.cfg.sft.eval_samples])
        logprobs = ray.get(self.learner.forward.remote(datums))
        total = sum(-lp * m for d, lps in zip(datums, logprobs) for lp, m in zip(lps, d.mask))
        return total / max(1.0, sum(sum(d.mask) for d in datums))

    def sft_warmup(self) -> dict[str, float]:
        sft = self.cfg.sft
        source = probe = None
        if self.cfg.envs:  # a game job warms up on chat data only, without the accuracy check
            env_name = sft.env or next(iter(self.cfg.envs))
            source = TaskSource(self.splits[env_name]["train"].tasks, seed=self.cfg.job.seed + 1)
            probe = source.tasks[: sft.check_samples]  # fixed training tasks for the early stop
        t0, losses, train_acc, steps = time.perf_counter(), [], None, 0
        for steps in range(1, sft.steps + 1):
            batch = (self.chat_batch(self.chat["train"].sample(sft.batch_size)) if self.chat  # chat demonstrations
                     else self.sft_batch(source.sample(sft.batch_size)))  # the env's prompts + completion_field
            fb = self.sft_update(batch, self.sft_lr(steps))
            losses.append(fb["loss"])
            if sft.stop_at_accuracy is not None and probe and steps % sft.check_every == 0:
                self.sync_weights()
                train_acc = self.accuracy(probe)
                self.log(f"  sft {steps}/{sft.steps}: loss {statistics.fmean(losses[-20:]):.3f}, "
                         f"train accuracy {train_acc:.3f}")
                if train_acc >= sft.stop_at_accuracy:
                    break
            elif steps % max(1, sft.steps // 5) == 0:
                self.log(f"  sft {steps}/{sft.steps}: loss {statistics.fmean(losses[-20:]):.3f}")
        self.sync_weights()
        return {"sft_steps": steps, "sft_loss": statistics.fmean(losses[-20:]) if losses else 0.0,
                "sft_train_accuracy": train_acc, "sft_s": time.perf_counter() - t0}

