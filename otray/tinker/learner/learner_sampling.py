"""LearnerSampling: sampling on the AdapterLearner's own model, between its training calls.

A sampler checkpoint (a directory ``AdapterLearner.save`` wrote) is loaded into one more adapter of the
learner's model, read-only, and kept while it is among the ``SAMPLER_CACHE`` most recently used
(:class:`~otray.tinker.learner.sampler_slots.SamplerSlots` keeps that bookkeeping; this class does the
model's side). A job with no checkpoint samples the base model, every adapter switched off. Samples go
through HF ``generate`` (:class:`~otray.actors.sampling.backends.hf.HFBackend` on the learner's model); a job
that asks for scores (top-K, targets) gets them from the same model (:mod:`prompt_scores`). Each sample
reports the weights version it came from (an inflight target's; None for a plain checkpoint).

The vLLM path beside the learner is :mod:`lora_sampler`; the service picks between them.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import json
import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

from otray.actors.sampling.backends.hf import HFBackend
from otray.tinker.learner.prompt_scores import Scoring
from otray.tinker.learner.sample_jobs import SampleJob, SampleOut, scores_of
from otray.tinker.learner.sampler_slots import SamplerSlots
from otray.tinker.learner.specs import AdapterSpec

SAMPLER_CACHE = 4  # sampler checkpoints kept loaded as adapters


class SamplingHost(Protocol):
    """What sampling needs of the learner it runs on (the AdapterLearner is one)."""

    model: Any  # the PeftModel holding every adapter (None before the first)
    base: torch.nn.Module  # the base model under it
    tokenizer: Any
    max_model_len: int
    device: str
    switch: Any  # its AdapterSwitch (every adapter off: ``switch.off(model)``)
    training: bool  # its model in train mode (a training call ran since the last :meth:`eval_mode`)

    def use(self, adapter: Optional[str]) -> None: ...  # make it the only active adapter

    def eval_mode(self, model: torch.nn.Module) -> None: ...

    def add_lora(self, name: str, spec: AdapterSpec) -> None: ...

    def remove_lora(self, name: str) -> None: ...


class LearnerSampling:
    """The sampler checkpoints ``learner`` holds loaded (``slots``) and its sampling calls."""

    def __init__(self, learner: SamplingHost, size: int = SAMPLER_CACHE):
        self.learner = learner
        self.slots = SamplerSlots(size)

    def holds(self, name: str) -> bool:
        """``name`` is an adapter this holds a sampler checkpoint in (or a sampling call in turns still uses)."""
        return name in self.slots.names() or name in self.slots.held

    def adapter_for(self, path: str) -> str:
        """The adapter name of sampler checkpoint ``path``, loading it on first use (into a spare adapter of
        its shape where there is one: making an adapter costs ~6x loading weights into one)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        name = self.slots.get(path)
        if name is not None:
            return name
        meta = json.loads((Path(path) / "otray_adapter.json").read_text())
        spec = AdapterSpec(**meta["spec"])
        name, gone = self.slots.place(spec)
        for old in gone:
            self.learner.remove_lora(old)
        if name is None:
            name = f"sampler-{random.randrange(10**9)}"
            self.learner.add_lora(name, spec)
        set_peft_model_state_dict(self.learner.model, load_file(str(Path(path) / "adapter_model.safetensors")),
                                  adapter_name=name)
        self.slots.loaded(path, name, spec, meta.get("version"))
        return name

    def sample(self, jobs: list[SampleJob], stop: Optional[Callable[[], bool]] = None) -> list[list[SampleOut]]:
        """Each job's prompts, ``n`` samples each (one generate call per job); per prompt a
        :class:`SampleOut`. ``stop`` (asked between tokens): True ends the call early, its samples cut
        where they were and no prompt scored (its caller abandoned it: the learner is free again)."""
        run = self.run(jobs, stop)
        while not run.turn():
            pass
        return run.outs

    def run(self, jobs: list[SampleJob], stop: Optional[Callable[[], bool]] = None,
            turn_s: Optional[float] = None, wanted: Optional[Callable[[], bool]] = None) -> "SampleRun":
        """:meth:`sample`'s call, to be run a turn at a time (:class:`SampleRun`)."""
        return SampleRun(self, jobs, stop, turn_s, wanted)


class SampleRun:
    """A learner sampling call in turns: each :meth:`turn` decodes its jobs, in order, up to the first decode step
    past ``turn_s`` seconds (None: a job's batch whole) at which ``wanted()`` says True (other work waits; None:
    always), so the learner's fair queue can run other users' steps between turns (``scheduling.sample_turn_ms``)
    and a call alone on the learner goes on in one turn. Each turn sets the model up again (the sampler adapter
    active, or every adapter off; eval mode after a training call), since training calls run between turns; the
    sampler checkpoint's adapter is held (:meth:`SamplerSlots.hold`) while its job runs, so every turn decodes
    with the weights its first had. A job's samples equal an uncut call's
    (:class:`~otray.actors.sampling.backends.hf_turns.Turns`)."""

    def __init__(self, sampling: LearnerSampling, jobs: list[SampleJob], stop: Optional[Callable[[], bool]],
                 turn_s: Optional[float], wanted: Optional[Callable[[], bool]] = None):
        self.sampling, self.jobs, self.stop, self.turn_s, self.wanted = sampling, jobs, stop, turn_s, wanted
        self.outs: list[list[SampleOut]] = []  # each finished job's
        self.calls: Optional[Any] = None  # the job under way's generate call (Turns)
        self.adapter: Optional[str] = None  # the adapter it holds
        self.version: Optional[int] = None

    def turn(self) -> bool:
        """The next piece of the call (a job's first turn loads its sampler checkpoint; its last scores its prompts
        when asked); True once every job is answered."""
        if len(self.outs) == len(self.jobs):
            return True
        job = self.jobs[len(self.outs)]
        learner, slots = self.sampling.learner, self.sampling.slots
        if self.calls is None and job.adapter is not None:  # loaded outside inference mode: autograd may use it
            self.adapter = self.sampling.adapter_for(job.adapter)
            slots.hold(self.adapter)
            self.version = slots.versions.get(self.adapter)
        try:
            if self.adapter is not None:
                learner.use(self.adapter)
            # with no adapter left (the last client dropped its own) the PEFT wrapper still names the deleted one
            # active and fails with a KeyError: the base model itself then (its LoRA layers hold nothing)
            held = learner.model is not None and bool(learner.model.peft_config)
            model = learner.model if held else learner.base
            off = learner.switch.off(learner.model) if (job.adapter is None and held) else nullcontext()
            if self.calls is None or learner.training:  # (model.eval() walks every module: ~2.6 ms a turn)
                learner.eval_mode(model)
            with off:
                if self.calls is None:
                    backend = HFBackend.on_model(model, learner.tokenizer, max_model_len=learner.max_model_len,
                                                 packed_linears=False)
                    pictures = {"images": job.images} if job.images else {}
                    self.calls = backend.turns(job.prompts, job.params, job.n, **pictures, stop=self.stop,
                                               turn_s=self.turn_s, wanted=self.wanted)
                done = self.calls.turn()
                while not done and self.turn_s is None:  # whole calls: every batch in this turn
                    done = self.calls.turn()
                if not done:
                    return False
                outs = [SampleOut(s, version=self.version) for s in self.calls.result()]
                if (job.scoring != Scoring() or job.targets) and not (self.stop is not None and self.stop()):
                    with torch.inference_mode():
                        for i, out in enumerate(outs):
                            out.scores = scores_of(model, job, i, [s.token_ids for s in out.samples], learner.device)
                            out.prompt_logprobs = out.scores.logprobs
        except BaseException:
            self._release()
            raise
        self._release()
        self.outs.append(outs)
        return len(self.outs) == len(self.jobs)

    @property
    def holding(self) -> bool:
        """A job is under way, its sampler adapter held (:meth:`close` frees it)."""
        return self.adapter is not None

    def close(self) -> None:
        """The call ends unfinished (its job failed in the queue): the adapter it held is free."""
        self._release()

    def _release(self) -> None:
        """The job under way ends: its adapter is no longer held."""
        if self.adapter is not None:
            self.sampling.slots.release(self.adapter)
        self.calls, self.adapter, self.version = None, None, None
