"""One HF ``generate`` call run in turns: :class:`Turns` decodes a call's batches a piece at a time and keeps
what a later piece needs (the sequences so far, their KV cache, the logprobs recorded, which rows ended, a seeded
call's random stream), so that its owner can do other work between the pieces: the Tinker learner runs other
users' steps there (:class:`~otray.tinker.learner.learner_sampling.LearnerSampling`), and ``otray serve`` sends
each piece's new text of a streamed answer (:class:`~otray.serve.streams.StreamTurns`), where the
call's tokens so far are :meth:`Turns.sofar`.

A piece is one ``generate`` over the batch's sequences so far with their cache: transformers feeds only the
tokens the cache lacks (the last one chosen), so each decode step computes what it would in one long call, and
the samples, logprobs and finish reasons equal an uncut call's (tests/actors/sampling/test_hf_turns.py). Rows
that ended in an earlier piece stay ended (:class:`Ended`); the one token they are given at the next piece's
first step (transformers starts each call with every row open) is cut as their padding would be. A call with
images, or on the compiled sampler, runs each batch whole in one turn.

Runs wherever its :class:`~otray.actors.sampling.backends.hf.HFBackend` runs (a rollout worker, the Tinker
learner)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from otray.actors.sampling.backends.base import (apply_stop_strings, check_prompt_lengths, effective_params,
                                                 stop_string_end)
from otray.actors.sampling.backends.hf_logits import ChosenLogprobs, StopWhen, processors
from otray.types import FinishReason, Sample, SamplingParams
from otray.vision import Image
from otray.vlm import unsampled_ids, vision_inputs


class TurnsBackend(Protocol):
    """What :class:`Turns` reads of its backend (an :class:`~otray.actors.sampling.backends.hf.HFBackend`, which
    imports this module: typed here by shape, not by class): the model and its tokenizer, its limits and ids, its
    compiled sampler (None: eager), packed linears and vision feature cache, and its token decoder."""

    model: Any
    tokenizer: Any
    max_model_len: int
    max_batch: int
    stop_token_ids: list[int]
    pad_id: int
    compiled: Any
    packed: Any
    features: Any

    def _decode(self, ids: list[int]) -> str: ...


class Ended:
    """A stopping criterion: every row that reached an end-of-sequence id or a stop string (``strings``:
    transformers' own criterion for them, or None), kept across the pieces of a call (``rows``): a row ended in
    an earlier piece ends again at the next piece's first step."""

    def __init__(self, eos: list[int], strings: Any, rows: int, device: torch.device):
        self.eos = torch.tensor(eos, device=device)
        self.strings = strings
        self.rows = torch.zeros(rows, dtype=torch.bool, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        now = torch.isin(input_ids[:, -1], self.eos) | self.rows
        if self.strings is not None:
            now = now | self.strings(input_ids, scores, **kwargs)
        self.rows = now
        return now


class Deadline:
    """A stopping criterion that ends a piece at its first decode step past ``at`` (``time.perf_counter``'s) at
    which ``wanted()`` says True (None: at once): every row stops there for now (:class:`Ended` keeps which rows
    really ended)."""

    def __init__(self, at: float, wanted: Optional[Callable[[], bool]] = None):
        self.at, self.wanted = at, wanted

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        due = time.perf_counter() >= self.at and (self.wanted is None or self.wanted())
        return torch.full((input_ids.shape[0],), due, dtype=torch.bool, device=input_ids.device)


@dataclass
class _Batch:
    """One batch's generation so far: its rows' prompts, the sequences (left-padded prompts, then the tokens
    chosen), their attention mask, the cache, the logprobs recorder, which rows ended, how many tokens each row
    was given (``made``) of its ``budget``."""

    rows: list[list[int]]
    pictures: list[Sequence[Image]]
    ids: torch.Tensor
    attn: torch.Tensor
    budget: int
    recorder: ChosenLogprobs
    ended: Ended
    cache: Any = None
    made: int = 0

    @property
    def width(self) -> int:
        return self.ids.shape[1] - self.made


class Turns:
    """``n`` samples of each of ``prompts`` (as ``backend``'s, an :class:`~otray.actors.sampling.backends.hf.HFBackend`,
    :meth:`~otray.actors.sampling.backends.hf.HFBackend.generate`), decoded a turn at a time: a
    :meth:`turn` ends at its first decode step past ``turn_s`` seconds (at least one step; None: a batch whole)
    at which ``wanted()`` says True (something else waits for the device; None: always), or after
    ``turn_tokens`` decode steps (None: no bound).
    ``stop``: asked before each turn and between tokens; True ends the call, every sample cut where it was."""

    def __init__(self, backend: TurnsBackend, prompts: list[list[int]], params: SamplingParams, n: int,
                 images: Optional[list[Sequence[Image]]] = None, stop: Optional[Callable[[], bool]] = None,
                 turn_s: Optional[float] = None, wanted: Optional[Callable[[], bool]] = None,
                 turn_tokens: Optional[int] = None):
        check_prompt_lengths(prompts, backend.max_model_len)
        if turn_tokens is not None and turn_tokens < 1:
            raise ValueError(f"turn_tokens must be at least 1 (a decode step a turn), got {turn_tokens}")
        self.backend, self.n, self.stop, self.turn_s, self.wanted = backend, n, stop, turn_s, wanted
        self.turn_tokens = turn_tokens
        self.params = effective_params(params, backend.stop_token_ids)
        self.prompts = len(prompts)
        self.rows = [p for p in prompts for _ in range(n)]
        self.pictures = [im for im in (images or [()] * len(prompts)) for _ in range(n)]
        if any(self.pictures):
            vision = vision_inputs(backend.model)
            for p, im in zip(prompts, images or []):
                vision.check_tokens(p, im)
        self.samples: list[Sample] = []
        self.batch: Optional[_Batch] = None
        self.stream: Optional[tuple[torch.Tensor, ...]] = None  # a seeded call's random state while it waits

    @property
    def done(self) -> bool:
        return len(self.samples) == len(self.rows)

    def result(self) -> list[list[Sample]]:
        """Each prompt's samples (once :attr:`done`)."""
        return [self.samples[i * self.n:(i + 1) * self.n] for i in range(self.prompts)]

    def sofar(self) -> list[tuple[list[int], Optional[FinishReason]]]:
        """Every row's tokens so far (row ``i * n + j``: prompt ``i``'s sample ``j``) and its finish reason, None
        while it runs (a row of the batch under way that reached its token limit too, until the batch ends): a
        finished row's sample as :meth:`result` will give it; a row of the batch under way up to the stop id that
        ended it (``STOP``), or cut after the token that completed a stop string (``STOP_STRING``); a row of a
        batch not begun yet has no tokens."""
        out: list[tuple[list[int], Optional[FinishReason]]] = [(s.token_ids, s.finish_reason) for s in self.samples]
        batch = self.batch
        if batch is not None:
            stops, strings = set(self.params.stop_token_ids), self.params.stop
            for row, toks in zip(batch.rows, batch.ids[:, batch.width:].cpu().tolist()):
                toks = toks[:min(self.params.max_tokens, self.backend.max_model_len - len(row))]
                end = next((k + 1 for k, t in enumerate(toks) if t in stops), None)
                cut = stop_string_end(self.backend._decode, toks[:end], strings) if strings else None
                if cut is not None:
                    out.append((toks[:cut], FinishReason.STOP_STRING))
                elif end is not None:
                    out.append((toks[:end], FinishReason.STOP))
                else:
                    out.append((toks, None))
        return out + [([], None)] * (len(self.rows) - len(out))

    def turn(self) -> bool:
        """Decode the next piece (starting the next batch when none is under way); True once every batch is done."""
        if self.done:
            return True
        deadline = None if self.turn_s is None else time.perf_counter() + self.turn_s
        seeded = self.params.seed is not None
        outside = _rng_state(self.backend.model.device) if seeded else None  # the process's random state
        if seeded and self.stream is None:  # a call's first turn seeds the process's stream, as an uncut call does
            torch.manual_seed(self.params.seed)
        elif seeded:  # later ones resume the call's own
            _set_rng_state(self.stream, self.backend.model.device)
        with torch.inference_mode():
            self._piece(deadline)
        if seeded and not self.done:  # waiting: its stream kept apart, the process's as it was before the turn
            self.stream = _rng_state(self.backend.model.device)
            _set_rng_state(outside, self.backend.model.device)
        return self.done

    def _piece(self, deadline: Optional[float]) -> None:
        b = self.backend
        start = len(self.samples)
        rows, pictures = self.rows[start:start + b.max_batch], self.pictures[start:start + b.max_batch]
        if self.stop is not None and self.stop():
            cut = [self._samples(self.batch)] if self.batch is not None else []
            self.batch = None
            self.samples.extend(s for part in cut for s in part)
            self.samples.extend(Sample([], [], FinishReason.LENGTH) for _ in range(len(self.rows) - len(self.samples)))
        elif b.compiled is not None and not any(pictures):
            self.samples.extend(apply_stop_strings(s, b._decode, self.params.stop)
                                for s in b.compiled.sample(rows, self.params, b._decode, self.stop))
        else:
            batch = self.batch or self._begin(rows, pictures)
            if batch.made < batch.budget:
                self._decode(batch, None if any(pictures) else deadline)
            if batch.made >= batch.budget or bool(batch.ended.rows.all()) or (self.stop is not None and self.stop()):
                self.batch = None
                self.samples.extend(self._samples(batch))
            else:
                self.batch = batch

    def _begin(self, rows: list[list[int]], pictures: list[Sequence[Image]]) -> _Batch:
        b = self.backend
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), b.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            attn[i, width - len(r):] = 1
        device = b.model.device
        if device.type != "cpu":
            ids, attn = ids.to(device), attn.to(device)
        budget = min(self.params.max_tokens, b.max_model_len - min(len(r) for r in rows))
        strings = None
        if self.params.stop:  # end rows early at a stop string (the exact cut is made in _samples)
            from transformers import StopStringCriteria

            strings = StopStringCriteria(b.tokenizer, list(self.params.stop))
        eos = list(self.params.stop_token_ids or b.stop_token_ids)
        return _Batch(rows, pictures, ids, attn, budget, ChosenLogprobs(), Ended(eos, strings, len(rows), device))

    def _decode(self, batch: _Batch, deadline: Optional[float]) -> None:
        """``batch``'s next decode steps: to its budget, or to the first step past ``deadline``, every row's end or
        the call's stop."""
        from transformers import GenerationConfig, StoppingCriteriaList

        b, params = self.backend, self.params
        # the model's own generation defaults (a hub model's temperature, top_k, repetition penalty) are
        # overridden: what shapes sampling is ``processors``', after the raw logprobs are recorded
        sampling = {"do_sample": False, "repetition_penalty": 1.0} if params.greedy else {
            "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
        eos = list(params.stop_token_ids or b.stop_token_ids)
        # a config of its own: without one, transformers rebuilds the model's config to check it (~2 ms a call)
        steps = batch.budget - batch.made if self.turn_tokens is None else min(batch.budget - batch.made,
                                                                               self.turn_tokens)
        config = GenerationConfig(max_new_tokens=steps, eos_token_id=eos, pad_token_id=b.pad_id,
                                  return_dict_in_generate=True, **sampling)
        criteria = [batch.ended] + ([StopWhen(self.stop)] if self.stop is not None else []) + (
            [Deadline(deadline, self.wanted)] if deadline is not None else [])
        images = [im for row in batch.pictures for im in row]
        inputs = vision_inputs(b.model).model_kwargs(batch.ids, batch.pictures) if images else {}
        with b.packed.active(b.model) if b.packed else nullcontext(), \
                b.features.serving(b.model, images) if images else nullcontext():
            out = b.model.generate(
                input_ids=batch.ids, attention_mask=batch.attn, generation_config=config, past_key_values=batch.cache,
                stopping_criteria=StoppingCriteriaList(criteria),
                logits_processor=processors(params, batch.recorder, batch.width, batch.budget if params.ignore_eos else 0,
                                            eos, unsampled_ids(b.model.config), str(b.model.device)), **inputs)
        grown = out.sequences.shape[1] - batch.ids.shape[1]
        batch.ids, batch.cache, batch.made = out.sequences, out.past_key_values, batch.made + grown
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((batch.attn.shape[0], grown))], dim=1)

    def _samples(self, batch: _Batch) -> list[Sample]:
        """The batch's samples: each row's tokens up to its end (a stop id, its limit, a stop string)."""
        params, b = self.params, self.backend
        new = batch.ids[:, batch.width:]
        chosen = batch.recorder.finish(new).cpu()
        new = new.cpu()  # one host copy of each
        stops = set(params.stop_token_ids)
        result = []
        for i, r in enumerate(batch.rows):
            limit = min(params.max_tokens, b.max_model_len - len(r))
            toks, lps, reason = [], [], FinishReason.LENGTH
            for t, lp in zip(new[i].tolist(), chosen[i].tolist()):
                if len(toks) >= limit:
                    break
                toks.append(t)
                lps.append(lp)
                if t in stops:
                    reason = FinishReason.STOP
                    break
            result.append(apply_stop_strings(Sample(toks, lps, reason), b._decode, params.stop))
        return result


def _rng_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The process's random state: the CPU's, and the device's where it is a GPU (sampling draws there)."""
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def _set_rng_state(state: tuple[torch.Tensor, ...], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state(state[1], device)
