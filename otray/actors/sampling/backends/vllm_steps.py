"""vLLM's engine a step at a time: requests added and aborted between steps, each step reporting every running
choice's new tokens.

``LLM.generate`` (what :meth:`VLLMBackend.generate` calls) adds its requests and runs the engine until every
request it holds has ended, so a request cannot join while others decode and an answer cannot be read before its
end. A server that streams answers and admits requests as they come (continuous batching:
:class:`otray.serve.engine_loop.EngineLoop`) drives the engine through this class instead. Never both on one
engine: ``generate`` would run this driver's requests to their ends and take their outputs.

The samples equal ``generate``'s for the same settings: the same sampling parameters
(:meth:`VLLMBackend.engine_params`), budget per prompt, finish reasons and stop-string cut
(:meth:`VLLMBackend.sample`).

Runs in the process that holds the :class:`~otray.actors.sampling.backends.vllm.VLLMBackend` (a Serve replica),
on one thread at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from otray.actors.sampling.backends.base import check_prompt_lengths, effective_params
from otray.actors.sampling.backends.vllm import VLLMBackend, engine_call, finish_reason
from otray.types import FinishReason, Sample, SamplingParams


@dataclass
class Progress:
    """One step's news of one choice of a request: its new tokens and their logprobs, and how it ended (None:
    it goes on)."""

    request: str
    choice: int
    token_ids: list[int]
    logprobs: list[float]
    finish: Optional[FinishReason]
    cached_prompt_tokens: int


class EngineSteps:
    """The engine of ``backend``, driven by :meth:`add`, :meth:`step` and :meth:`abort` (each under the backend's
    engine lock: another engine of this process may be driven from another thread)."""

    def __init__(self, backend: VLLMBackend):
        self.backend, self.lock = backend, backend.lock
        self.engine = backend.llm.llm_engine

    @property
    @engine_call
    def busy(self) -> bool:
        """Whether a request is running (or waiting in the engine's own queue)."""
        return self.engine.has_unfinished_requests()

    @engine_call
    def add(self, request: str, prompt: list[int], params: SamplingParams, n: int, adapter: Any = None,
            images: tuple[Any, ...] = (), stream: bool = True) -> SamplingParams:
        """Start ``request`` (an id unique among running ones): ``n`` choices of ``prompt`` under ``adapter`` (an
        :meth:`VLLMBackend.add_adapter` handle, or None: the base weights), each step reporting its choices' new
        tokens (``stream``; else its choices whole, at the end). Raises for a prompt the engine cannot take (too
        long, images that do not match), having added nothing. Returns the settings it runs with (the end-of-turn
        ids filled in: :meth:`sample` takes them)."""
        check_prompt_lengths([prompt], self.backend.max_model_len)
        inputs = self.backend.engine_inputs([prompt], [images] if images else None)[0]
        render = getattr(self.backend.llm, "_preprocess_cmpl_one", None)  # vLLM 0.32's renderer, as ``generate``
        inputs = render(inputs) if render is not None else inputs  # uses it (raw prompts: a deprecated path)
        params = effective_params(params, self.backend.stop_token_ids)
        budget = min(params.max_tokens, self.backend.max_model_len - len(prompt))
        self.engine.add_request(request, inputs, self.backend.engine_params(params, n, budget, stream),
                                lora_request=adapter)
        return params

    @engine_call
    def step(self) -> list[Progress]:
        """One engine step: each running choice's new tokens (a choice that ended reports its end once)."""
        out = []
        for got in self.engine.step():
            for c in got.outputs:
                ids = list(c.token_ids)
                lps = [c.logprobs[j][t].logprob for j, t in enumerate(ids)] if c.logprobs else [0.0] * len(ids)
                end = finish_reason(c) if c.finish_reason is not None else None
                out.append(Progress(got.request_id, c.index, ids, lps, end, got.num_cached_tokens or 0))
        return out

    @engine_call
    def abort(self, request: str) -> None:
        """End ``request`` now (every choice of it); it reports nothing more."""
        self.engine.abort_request([request])

    def sample(self, params: SamplingParams, ids: list[int], logprobs: list[float], finish: FinishReason,
               cached: int) -> Sample:
        """A choice that ended (under the settings :meth:`add` returned), as :meth:`VLLMBackend.generate` gives it:
        cut after a completed stop string."""
        return self.backend.sample(ids, logprobs, finish, cached, tuple(params.stop))
