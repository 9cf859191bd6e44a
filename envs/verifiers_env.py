"""Any installed ``verifiers`` environment as an otray env (``entry: verifiers``), through the package's
own rollout loop and rubric.

Config::

    envs:
      reverse:
        entry: verifiers
        kwargs: {env_id: reverse_text, env_args: {}}
        dataset: {builder: envs.verifiers_env:make_dataset, dir: .cache/data/vf_reverse,
                  kwargs: {env_id: reverse_text, num_train: -1, num_eval: 100}}

``env_id`` names an installed environment module (the Environments Hub's packages: ``reverse-text`` is the
module ``reverse_text``), loaded with ``verifiers.load_environment(env_id, **env_args)``; on a shared
cluster its module is code an admin allows (docs/security.md). The dataset builder writes the env's own
``get_dataset`` (``train``) and ``get_eval_dataset`` (``eval``) rows.

One episode is one ``run_rollout`` of the verifiers env, which asks its client for each model reply: the
client here is :class:`_Bridge`, which hands the request's messages to ``reset``/``step`` and waits for
the policy's reply (otray generates it). So single-turn, multi-turn (``env_response``) and tool envs
play by their own rules. The first observation is the prompt's user text (its system message becomes the
env's system prompt); later observations are the messages the env appended (``<tool_response>`` blocks
for tool results). Tool calls use otray's ``<tool_call>`` format and reach the env as OpenAI
``tool_calls``; the env's tools are listed in ``Env.tool_specs``. When the rollout ends, the env's rubric
scores it (``score_rollout``): its reward is the episode's reward and its metrics go to ``info``. A rollout
that the env aborted with an error is an error record with that error.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import Any

from otray.env import Env, StepResult, atomic_write, dataset_paths, register
from otray.loop_thread import event_loop, submit
from otray.tools import parse_tool_calls
from otray.types import ConfigError, EnvStateError, OtrayError, Task

_envs: dict[str, Any] = {}  # (env_id, env_args) -> the loaded verifiers env (loaded once per process)


class VerifiersRolloutError(OtrayError, RuntimeError):
    """The verifiers env ended the rollout with an error, or did not answer in time."""


def load(env_id: str, env_args: dict[str, Any] | None = None) -> Any:
    """The verifiers env ``env_id`` with ``env_args`` (loaded once per process)."""
    import verifiers as vf

    key = json.dumps([env_id, env_args or {}], sort_keys=True)
    if key not in _envs:
        try:
            _envs[key] = vf.load_environment(env_id, **(env_args or {}))
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"cannot load the verifiers environment {env_id!r}: {e} (install its package; "
                              "its module is env_id with '-' as '_')") from e
    return _envs[key]


class _Bridge:
    """An ``AsyncOpenAI`` stand-in for one rollout: each ``chat.completions.create`` publishes the request
    and waits for the policy's reply, which ``VerifiersEnv.step`` delivers."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[tuple[list[dict[str, Any]], asyncio.Future]] = asyncio.Queue()
        self.chat = self
        self.completions = self

    async def create(self, *, model: str, messages: list[dict[str, Any]], tools: Any = None, **_: Any) -> Any:
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        await self.requests.put((list(messages), reply))
        return completion(await reply, bool(tools), model)


def completion(text: str, with_tools: bool, model: str) -> Any:
    """The policy's reply as an OpenAI ``ChatCompletion``: otray's ``<tool_call>`` blocks as ``tool_calls``
    when the env offers tools (the text around them as the content)."""
    from openai.types.chat import ChatCompletion

    message: dict[str, Any] = {"role": "assistant", "content": text}
    parsed = parse_tool_calls(text) if with_tools else None
    if parsed is not None and parsed.calls:
        message["content"] = parsed.text.strip() or None
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for c in parsed.calls]
    return ChatCompletion.model_validate({
        "id": f"otray-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [{"index": 0, "message": message,
                                     "finish_reason": "tool_calls" if "tool_calls" in message else "stop"}]})


def render(messages: list[dict[str, Any]]) -> str:
    """Messages the env appended, as the next observation: text as it is, tool results in
    ``<tool_response>`` blocks."""
    out = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else " ".join(
            p.get("text", "") for p in content or [] if isinstance(p, dict))
        out.append(f"<tool_response>{text}</tool_response>" if m.get("role") == "tool" else text)
    return "\n".join(out)


class VerifiersEnv(Env):
    """One verifiers rollout per episode (see the module docstring)."""

    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None, max_turns: int = 8,
                 timeout_s: float = 300.0, **unknown: Any):
        if unknown:
            raise ConfigError(f"envs.<name>.kwargs: unknown key(s) {sorted(unknown)} for entry verifiers; valid: "
                              "env_id, env_args, max_turns, timeout_s")
        self.env_id, self.env_args = env_id, dict(env_args or {})
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.system_prompt: str | None = None
        self.tool_specs: list[dict[str, Any]] | None = None
        self._rollout: Any = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.close()
        env = load(self.env_id, self.env_args)
        if "prompt" not in task.data:
            raise ConfigError(f"task {task.id!r} has no 'prompt': build the rows with envs.verifiers_env:make_dataset")
        row = {k: task.data[k] for k in ("prompt", "answer", "task", "info", "example_id") if k in task.data}
        self._bridge = _Bridge()
        self._rollout = submit(self._run(env, row))
        messages = self._next()
        if messages is None:
            raise VerifiersRolloutError(f"{self.env_id}: the rollout ended before asking the model")
        self.system_prompt = "\n".join(m["content"] for m in messages if m.get("role") == "system") or None
        tools = getattr(env, "oai_tools", None) or []
        self.tool_specs = [t.get("function", t) for t in tools] or None
        self._seen = len(messages)
        return render([m for m in messages if m.get("role") != "system"]), {}

    async def _run(self, env: Any, row: dict[str, Any]) -> Any:
        gen, score = asyncio.Semaphore(1), asyncio.Semaphore(1)
        return await env.run_rollout(row, self._bridge, "otray-policy", {}, gen, score, score=True)

    def _next(self) -> list[dict[str, Any]] | None:
        """Wait for the rollout's next model request (its messages), or its end (None)."""
        waiter = submit(self._bridge.requests.get())
        wait([waiter, self._rollout], timeout=self.timeout_s, return_when=FIRST_COMPLETED)
        if waiter.done():
            messages, self._reply = waiter.result()
            return messages
        waiter.cancel()
        if self._rollout.done():
            return None
        raise VerifiersRolloutError(f"{self.env_id}: no model request or end of the rollout in {self.timeout_s:g} s")

    def step(self, action: str) -> StepResult:
        if self._rollout is None or self._rollout.done():
            raise EnvStateError("VerifiersEnv.step called before reset (or after the episode ended)")
        event_loop().call_soon_threadsafe(self._reply.set_result, action)  # (futures belong to their loop)
        messages = self._next()
        if messages is None:
            return self._end()
        shown = messages[self._seen + 1:]  # after the previous prompt and the policy's reply
        self._seen = len(messages)
        return StepResult(render(shown), None, False, {})

    def _end(self) -> StepResult:
        state = self._rollout.result()
        self._rollout = None
        if state.get("error") is not None:
            raise VerifiersRolloutError(f"{self.env_id}: the rollout ended with an error: {state['error']}")
        metrics = {k: v for k, v in (state.get("metrics") or {}).items() if isinstance(v, (int, float, bool))}
        final = state.get("final_env_response") or []
        reward = float(state.get("reward") or 0.0)
        return StepResult(render(final) if final else "", reward, True,
                          {**metrics, "stop_condition": str(state.get("stop_condition")), "correct": reward > 0},
                          finished=not state.get("is_truncated", False))

    def close(self) -> None:
        rollout, self._rollout = self._rollout, None
        if rollout is not None and not rollout.done():
            rollout.cancel()


register("verifiers", VerifiersEnv)


def make_dataset(out_dir: str | Path, *, env_id: str, env_args: dict[str, Any] | None = None, num_train: int = -1,
                 num_eval: int = -1, seed: int | None = 0) -> dict[str, Path]:
    """The env's own datasets as JSONL (``train``: ``get_dataset``, ``eval``: ``get_eval_dataset``, or
    the train set when the env has no eval set): rows ``{id, prompt, answer, task, info, example_id}``.
    ``num_*``: how many rows (-1: all). Idempotent per directory."""
    env = load(env_id, env_args)
    tag = env_id.replace("/", "_")
    paths, built = dataset_paths(out_dir, {"train": f"{tag}-train.jsonl", "eval": f"{tag}-eval.jsonl"})
    if built:
        return paths
    for split, n in (("train", num_train), ("eval", num_eval)):
        try:
            ds = env.get_dataset(n=n, seed=seed) if split == "train" else env.get_eval_dataset(n=n, seed=seed)
        except ValueError as e:
            raise ConfigError(f"verifiers env {env_id!r} has no {split} dataset: {e}") from e
        with atomic_write(paths[split]) as f:
            for i, row in enumerate(ds):
                keep = {k: row[k] for k in ("prompt", "answer", "task", "info", "example_id") if k in row}
                f.write(json.dumps({"id": f"{split}-{row.get('example_id', i)}", **keep}, default=str) + "\n")
    return paths
