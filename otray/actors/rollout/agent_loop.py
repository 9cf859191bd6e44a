"""Single-agent multi-turn rollouts: a token-in, token-out state machine.

Each episode moves PENDING -> GENERATING <-> INTERACTING -> TERMINATED:

- PENDING: ``env.reset`` gives the first user message; the prompt is the chat
  template of (system, user) with the generation prompt.
- GENERATING: all generating episodes share one batched ``generate`` call. The
  sampled ids are appended as they are (mask 1, with the sampler's logprobs).
- INTERACTING: the decoded text goes to ``env.step``. If the episode goes on, the
  observation is appended as *new* tokens: the chat template's continuation
  after the assistant turn (mask 0). Text the policy produced is never re-tokenized.
- TERMINATED: done, truncated (``max_turns``, per-episode token budget, context
  full) or errored (an env exception, or a call past its time limit, becomes
  ``Trajectory.error``). Its env is closed right away (a remote session is freed
  as soon as its episode ends, not at the end of the batch).

Env calls of one phase (every episode's ``reset``, every interacting episode's
``step``, the ``close`` of those that ended) run concurrently and under time limits
as each env's :class:`~otray.actors.rollout.env_io.EnvIO` says (``Limits.env_io``).
"""

from __future__ import annotations

import enum
import functools
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from otray.actors.rollout.env_io import EnvIO, EnvTimeout, call_all
from otray.env import Env
from otray.models import chat_prompt_ids, template_takes_tools
from otray.tools import system_with_tools
from otray.types import ErrorRecord, FinishReason, GenerateResult, SamplingParams, Task, Trajectory
from otray.vision import ImageError, images_of, template_content, text_of
from otray.vlm import VisionInputs, observation_prompt, vision_inputs_at

# (prompts, params, n) -> results; called with ``images=`` (each prompt's images) when an episode has any
GenerateFn = Callable[..., list[GenerateResult]]


class State(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class Limits:
    max_turns: int = 1
    max_tokens_per_turn: int = 64
    max_tokens_per_episode: int = 512  # sampled tokens, summed over turns
    max_model_len: int = 512
    env_io: EnvIO = field(default_factory=EnvIO)  # env calls: concurrency and time limits


class ChatContinuation:
    """Token ids that close an assistant turn and open the next user/assistant turns, and the ids of a
    conversation's first user turn.

    Rendering a chat template (Jinja) for every decision was a large part of a game phase's time outside
    generate. A template that writes a message's content verbatim renders ``[..., user(text)]`` as a
    fixed prefix, the text, and a fixed suffix; both are found once by rendering a probe, and reused
    while the probe shows the template is verbatim (else every call renders the template)."""

    CACHE_TEXTS = 4096  # texts whose ids are kept (emptied when full)
    _PROBE = " otray probe\n<b>{x}</b>  "  # spaces, a newline, markup: a template that trims or escapes differs

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        marker = "\x00OTRAY\x00"
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
        self._base_text = tokenizer.apply_chat_template(base, tokenize=False)
        self._close = self._base_text.split(marker, 1)[1]  # e.g. "<|im_end|>\n"
        self._base = base
        self._next = self._split(base)  # the next user turn after an assistant turn
        self._first: dict[str | None, tuple[str, str] | None] = {}  # per system prompt
        self._stop_text: dict[int, str] = {}
        self._encoded: dict[str, tuple[int, ...]] = {}  # text -> ids, at most CACHE_TEXTS of them

    def _render(self, before: list[dict[str, str]], text: str | list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(before + [{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)

    def _split(self, before: list[dict[str, str]]) -> tuple[str, str] | None:
        """(prefix, suffix) around a user turn's text after ``before``, or None if the template is not verbatim."""
        probe = self._render(before, self._PROBE)
        if probe.count(self._PROBE) != 1:
            return None
        prefix, suffix = probe.split(self._PROBE)
        other = "second probe: x"
        return (prefix, suffix) if self._render(before, other) == prefix + other + suffix else None

    def next_text(self, observation: str | list[dict[str, str]], sampled_stop_token: int | None) -> str:
        """The text that closes the assistant turn and opens the next (user ``observation``, then the assistant's
        generation prompt), less the stop token the sampler already wrote (its ids are in the trajectory).
        ``observation``: a string, or a vision-language template's content list (rendered by the template)."""
        if self._next is not None and isinstance(observation, str):
            prefix, suffix = self._next
            full_tail = prefix[len(self._base_text):] + observation + suffix
        else:
            full_tail = self._render(self._base, observation)[len(self._base_text):]
        text = self._close + full_tail
        if sampled_stop_token is not None:
            stop_text = self._stop_text.get(sampled_stop_token)
            if stop_text is None:
                stop_text = self._stop_text[sampled_stop_token] = self.tokenizer.decode([sampled_stop_token])
            if text.startswith(stop_text):
                text = text[len(stop_text):]
        return text

    def ids(self, observation: str | list[dict[str, str]], sampled_stop_token: int | None) -> list[int]:
        """The ids of :meth:`next_text`."""
        return self.encode_many([self.next_text(observation, sampled_stop_token)])[0]

    def first_text(self, observation: str, system_prompt: str | None = None) -> str | None:
        """The text of ``[system?, user(observation)]`` with the generation prompt, or None for a template that
        does not write content verbatim (then :meth:`first_ids` renders it)."""
        if system_prompt not in self._first:
            self._first[system_prompt] = self._split(
                [{"role": "system", "content": system_prompt}] if system_prompt else [])
        split = self._first[system_prompt]
        return None if split is None else split[0] + observation + split[1]

    def first_ids(self, observation: str, system_prompt: str | None = None) -> list[int]:
        """The ids of ``[system?, user(observation)]`` with the generation prompt (``chat_prompt_ids``)."""
        text = self.first_text(observation, system_prompt)
        if text is None:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
            return chat_prompt_ids(self.tokenizer, messages + [{"role": "user", "content": observation}])
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids (no special tokens added): texts seen lately from a bounded cache (a game's opening
        position is every game's first prompt), the rest in one call to the tokenizer's Rust backend where it
        has one (``backend_tokenizer``: what ``tokenizer.encode`` runs, without its per-call Python)."""
        found = {t: self._encoded.get(t) for t in texts}
        missing = [t for t, ids in found.items() if ids is None]
        if missing:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is not None:
                fresh = [e.ids for e in backend.encode_batch(missing, add_special_tokens=False)]
            else:
                fresh = [self.tokenizer.encode(t, add_special_tokens=False) for t in missing]
            new = dict(zip(missing, map(tuple, fresh)))
            found.update(new)
            if len(self._encoded) + len(new) > self.CACHE_TEXTS:
                self._encoded.clear()
            self._encoded.update(new)
        return [list(found[t]) for t in texts]


@dataclass
class _Episode:
    env: Env
    traj: Trajectory
    limits: Limits
    params: SamplingParams
    state: State = State.PENDING
    seed: int | None = None
    started_at: float = 0.0  # time.monotonic() at reset, for the episode's time limit
    closed: bool = False


class AgentLoop:
    """Runs many episodes concurrently against one ``generate`` function."""

    def __init__(self, tokenizer: Any, generate: GenerateFn, limits: Limits):
        self.tokenizer = tokenizer
        self.generate = generate
        self.limits = limits
        self.continuation = ChatContinuation(tokenizer)
        self.template_tools = template_takes_tools(tokenizer)  # env tools via the template's tools=
        self.vision: VisionInputs | None = None  # a vision-language model's image inputs, found at the first image
        self.generate_s = 0.0  # time spent in ``generate`` calls, summed over runs

    def run(self, episodes: Sequence[tuple[Task, Env, int | None]], params: SamplingParams) -> list[Trajectory]:
        """Run ``episodes`` (task, env, seed) to the end with this loop's limits."""
        return self.run_many([(episodes, params, self.limits)])

    def run_many(self, batches: Sequence[tuple[Sequence[tuple[Task, Env, int | None]], SamplingParams, Limits]]
                 ) -> list[Trajectory]:
        """Episodes of several envs at once, each batch with its own sampling params and limits.

        Every turn, all generating episodes share generate calls (one per distinct
        params and token budget), so envs batch together. Trajectories come back in
        the order of the batches and their episodes.
        """
        eps = [_Episode(env, Trajectory(task=task), limits, params, seed=seed)
               for episodes, params, limits in batches for task, env, seed in episodes]
        for ep, out in zip(eps, self._env_calls(eps, lambda ep: ep.env.reset(ep.traj.task, seed=ep.seed), start=True)):
            self._start(ep, out)
        self._close_ended(eps)
        while True:
            active = [ep for ep in eps if ep.state is State.GENERATING]
            if not active:
                break
            self._generate_turn(active)
            interacting = [ep for ep in active if ep.state is State.INTERACTING]
            for ep in interacting:
                ep.traj.num_turns += 1
            steps = self._env_calls(interacting, lambda ep: ep.env.step(ep.traj.messages[-1]["content"]))
            for ep, out in zip(interacting, steps):
                self._interact(ep, out)
            self._close_ended(active)
        return [ep.traj for ep in eps]

    # ------------------------------------------------------------------ env calls

    def _env_calls(self, eps: list[_Episode], call: Callable[[_Episode], Any], start: bool = False) -> list[Any]:
        """``call(ep)`` for every episode, concurrently as their EnvIO allows, each limited to its call's
        time limit and what is left of its episode's; returns values or exceptions."""
        now = time.monotonic()
        jobs, skipped = [], {}
        for i, ep in enumerate(eps):
            io = ep.limits.env_io
            if start:
                ep.started_at = now
            limit = io.timeout_s
            if io.episode_timeout_s is not None:
                left = io.episode_timeout_s - (now - ep.started_at)
                limit = left if limit is None else min(limit, left)
            if limit is not None and limit <= 0:
                skipped[i] = EnvTimeout(f"the episode ran past its time limit ({io.episode_timeout_s:g} s of env calls)")
                continue
            jobs.append((functools.partial(call, ep), io, limit))
        results = iter(call_all(jobs))
        return [skipped[i] if i in skipped else next(results) for i in range(len(eps))]

    def _close_ended(self, eps: list[_Episode]) -> None:
        """Close the envs of episodes that have ended (errors in ``close`` must not lose a trajectory)."""
        ended = [ep for ep in eps if ep.state is State.TERMINATED and not ep.closed]
        for ep in ended:
            ep.closed = True
        self._env_calls(ended, lambda ep: ep.env.close())

    # ------------------------------------------------------------------ transitions

    def _start(self, ep: _Episode, out: Any) -> None:
        if isinstance(out, BaseException):  # an env failure is a value, not a crash
            return self._fail(ep, "env_timeout" if isinstance(out, EnvTimeout) else "env_exception", out)
        first, info = out
        tools = getattr(ep.env, "tool_specs", None)
        in_template = bool(tools) and self.template_tools
        system = ep.env.system_prompt if in_template else system_with_tools(tools, ep.env.system_prompt)
        messages = ([{"role": "system", "content": system}] if system else [])
        try:
            ids, images = observation_prompt(self.tokenizer, messages, first, tools if in_template else None)
        except ImageError as e:  # an unusable image, or an image for a text-only model: this episode fails
            return self._fail(ep, "bad_observation", e)
        messages.append({"role": "user", "content": text_of(first)})
        ep.traj.messages = messages
        ep.traj.info.update(info)
        ep.traj.images.extend(images)
        ep.traj.append(ids, sampled=False)
        ep.traj.prompt_len = len(ids)
        if len(ids) >= ep.limits.max_model_len:
            return self._fail(ep, "prompt_too_long",
                              f"prompt has {len(ids)} tokens; the context is {ep.limits.max_model_len}")
        ep.state = State.GENERATING

    def _vision(self) -> VisionInputs:
        """The model's image inputs (found by the tokenizer's directory): an ImageError for a text-only model."""
        if self.vision is None:
            self.vision = vision_inputs_at(str(getattr(self.tokenizer, "name_or_path", "")))
        return self.vision

    def _turn_budget(self, ep: _Episode) -> int:
        lim = ep.limits
        return min(lim.max_tokens_per_turn, lim.max_tokens_per_episode - ep.traj.num_sampled,
                   lim.max_model_len - len(ep.traj.token_ids))

    def _generate_turn(self, active: list[_Episode]) -> None:
        calls: dict[tuple[int, int], list[_Episode]] = {}  # (id of params, token budget) -> episodes
        for ep in active:
            calls.setdefault((id(ep.params), self._turn_budget(ep)), []).append(ep)
        for (_, budget), group in calls.items():
            t0 = time.perf_counter()
            pictures = {"images": [tuple(ep.traj.images) for ep in group]} if any(ep.traj.images for ep in group) else {}
            try:
                results = self.generate([ep.traj.token_ids for ep in group],
                                        replace(group[0].params, max_tokens=budget), 1, **pictures)
            except Exception as e:  # noqa: BLE001 - a failed call fails these episodes only
                for ep in group:
                    self._fail(ep, "rollout_failed", e)
                continue
            finally:
                self.generate_s += time.perf_counter() - t0
            for ep, res in zip(group, results):
                sample = res.samples[0]
                ep.traj.append(sample.token_ids, sampled=True, logprobs=sample.logprobs)
                ep.traj.policy_version = res.policy_version
                ep.traj.info["_last_stop"] = sample.token_ids[-1] if sample.finish_reason is FinishReason.STOP else None
                ep.traj.messages.append({"role": "assistant", "content": self._decode(sample.token_ids, sample.finish_reason)})
                ep.state = State.INTERACTING

    def _decode(self, ids: list[int], reason: FinishReason) -> str:
        body = ids[:-1] if reason is FinishReason.STOP else ids
        return self.tokenizer.decode(body, skip_special_tokens=False)

    def _interact(self, ep: _Episode, result: Any) -> None:
        traj = ep.traj
        if isinstance(result, BaseException):
            return self._fail(ep, "env_timeout" if isinstance(result, EnvTimeout) else "env_exception", result)
        traj.turn_rewards.append(None if result.reward is None else float(result.reward))
        traj.info.update(result.info)
        stop = traj.info.pop("_last_stop", None)
        if result.done:  # finished unless the env says it ended the episode unfinished
            traj.finished = result.finished is not False and result.info.get("finished") is not False
            ep.state = State.TERMINATED
            return
        out_of_budget = self._turn_budget(ep) <= 0
        if traj.num_turns >= ep.limits.max_turns or out_of_budget:
            traj.truncated = True
            ep.state = State.TERMINATED
            return
        try:
            images = images_of(result.observation)
            cont = self.continuation.ids(template_content(result.observation), stop)
            if images:
                vision = self._vision()
                vision.check_count(traj.images + images)
                cont = vision.expand(cont, images)
        except ImageError as e:
            return self._fail(ep, "bad_observation", e)
        if len(traj.token_ids) + len(cont) >= ep.limits.max_model_len:
            traj.truncated = True
            ep.state = State.TERMINATED
            return
        traj.append(cont, sampled=False)
        traj.images.extend(images)
        traj.messages.append({"role": "user", "content": text_of(result.observation)})
        ep.state = State.GENERATING

    def _fail(self, ep: _Episode, kind: str, err: BaseException | str) -> None:
        if isinstance(err, str):
            msg = err
        else:
            tb = "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=3))
            msg = f"{type(err).__name__}: {err}\n{tb}"
        ep.traj.error = ErrorRecord(kind, msg[:2000], turn=ep.traj.num_turns)
        ep.traj.info.pop("_last_stop", None)
        ep.state = State.TERMINATED
