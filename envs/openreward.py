"""Any OpenReward environment as an otray env (``entry: openreward``), through the ``openreward`` SDK.

Config::

    envs:
      tool_addition:
        entry: openreward
        kwargs: {environment: ToolAddition, base_url: "http://127.0.0.1:8090", variant: ToolAddition}
        dataset: {builder: envs.openreward:make_dataset, dir: .cache/data/or_tool_addition,
                  kwargs: {environment: ToolAddition, base_url: "http://127.0.0.1:8090", variant: ToolAddition}}
        stop: ["</tool_call>"]          # a turn ends with its tool call
        max_concurrency: 32             # sessions at a time
        timeout_s: 30                   # per env call; a hung tool is an error record, not a hung step

``tools_per_task: true`` asks each session for its tools (an env whose tools depend on the task);
by default an env's tools are fetched once per process (they belong to the env class).
``base_url`` is the env server (``local:MODULE`` starts ``python -m MODULE --port P`` in the
job's process for you); ``variant`` picks the env class on a server that holds several (without
it a session lands in the server's first env). The API key comes from ``OPENREWARD_API_KEY``
when set, never from the config.

One episode is one session: ``reset`` opens it on the task (``split``, ``index`` from the
dataset row), shows the prompt (text blocks as text, images as a visible placeholder: otray's
models read text) and offers the env's tools (``Env.tool_specs``: the chat template's ``tools=`` when
it takes them, else the system prompt); ``step`` runs every tool call in
the reply (otray's ``<tool_call>`` format) through the session. A ``ToolCallError`` (unknown
tool, bad arguments, episode over) becomes a ``<tool_error>`` observation and the episode goes
on; a ``ToolFailed`` (the tool raised) ends it as an error record. A reply with no tool call
goes to the env's ``@terminal`` tool when it has one, else gets a nudge. Rewards arrive inside
tool results and may be None; ``finished`` ends the episode. ``close`` ends the session.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from otray.env import Env, StepResult, atomic_write, dataset_paths, register
from otray.tools import parse_tool_calls
from otray.types import ConfigError, EnvStateError, Task

ERROR_CHARS = 200  # of a tool error shown to the model (pydantic's messages run long)
NUDGE = "Call one of the tools, as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
_lock = threading.Lock()
_client: Any = None
_servers: dict[str, str] = {}  # local:MODULE -> the URL of the server this process started
_tools: dict[tuple[str, str | None, str | None], tuple[list[dict[str, Any]], bool]] = {}  # env -> tools, terminal?


def specs_of(listed: Any) -> list[dict[str, Any]]:
    """The SDK's ToolSpecs as ``Env.tool_specs`` (OpenAI function shape)."""
    return [{"name": t.name, "description": t.description or "", "parameters": t.input_schema or {}} for t in listed]


FINAL_ANSWER = "Reply without a tool call to give your final answer."


def render_blocks(blocks: Any) -> str:
    """Text blocks as their text; an image as a visible placeholder (the model cannot see it)."""
    out = []
    for b in blocks:
        kind = getattr(b, "type", None)
        if kind == "text":
            out.append(b.text)
        elif kind == "image":
            out.append(f"[image {b.mimeType}, {len(b.data) * 3 // 4} bytes: not shown to this model]")
        else:
            out.append(f"[{kind} block]")
    return "\n".join(out)


def start_server(module: str, cwd: str | Path | None = None, wait_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m MODULE --port P`` on a free localhost port and wait until it accepts
    connections; returns the process and its URL. A server that exits or stays silent is a ConfigError."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port)], cwd=cwd,
                            env={**os.environ, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode()[-2000:] if proc.poll() is not None else f"no answer in {wait_s:g} s"
                proc.kill()
                raise ConfigError(f"the env server `python -m {module}` did not start ({err})") from None
            time.sleep(0.2)


def resolve_url(base_url: str | None) -> str | None:
    """``local:MODULE`` -> the URL of a ``python -m MODULE --port P`` server started once per process
    (stopped at exit); anything else as it is."""
    if not base_url or not base_url.startswith("local:"):
        return base_url
    with _lock:
        if base_url not in _servers:
            proc, _servers[base_url] = start_server(base_url.split(":", 1)[1])
            atexit.register(proc.terminate)
        return _servers[base_url]


def environment(name: str, base_url: str | None, variant: str | None) -> Any:
    """The SDK's handle on one environment (one client, and its event-loop thread, per process)."""
    global _client
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    url = resolve_url(base_url)
    with _lock:  # the SDK creates its environments API (and its event-loop thread) lazily: not thread-safe
        if _client is None:
            from openreward import OpenReward

            _client = OpenReward()  # the key from OPENREWARD_API_KEY (none needed for a local server)
        return _client.environments.get(name, variant=variant, base_url=url)


def _no_key_in_config(kwargs: dict[str, Any]) -> None:
    if {"api_key", "apikey", "key"} & set(kwargs):
        raise ConfigError("the OpenReward API key never goes in a config (configs are stored and shown): "
                          "remove it from kwargs and set OPENREWARD_API_KEY in the job's environment")
    if kwargs:
        raise ConfigError(f"envs.<name>.kwargs: unknown key(s) {sorted(kwargs)} for entry openreward; valid: "
                          "environment, base_url, variant, max_turns, nudge, tools_per_task")


class OpenRewardEnv(Env):
    """One OpenReward session per episode (see the module docstring)."""

    def __init__(self, environment: str, base_url: str | None = None, variant: str | None = None,
                 max_turns: int = 4, nudge: str = NUDGE, tools_per_task: bool = False, **unknown: Any):
        _no_key_in_config(unknown)
        self.name, self.base_url, self.variant = environment, base_url, variant
        self.max_turns, self.nudge, self.tools_per_task = max_turns, nudge, tools_per_task
        self.session: Any = None
        self.done = True
        self.system_prompt = None
        self.tool_specs: list[dict[str, Any]] | None = None
        self.has_terminal = False

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.close()
        if "split" not in task.data or "index" not in task.data:
            raise ConfigError(f"task {task.id!r} has no 'split'/'index': build the dataset with "
                              "envs.openreward:make_dataset")
        env = environment(self.name, self.base_url, self.variant)
        self.session = env.session(split=str(task.data["split"]), index=int(task.data["index"]))
        self.session.__enter__()
        prompt = render_blocks(self.session.get_prompt())
        tools, self.has_terminal = self._tool_list(env)
        self.tool_specs = tools or None
        self.system_prompt = FINAL_ANSWER if self.has_terminal and self.tool_specs else None
        self.done, self.calls, self.errors = False, 0, 0
        return prompt, {"tool_calls": 0, "tool_errors": 0}

    def _tool_list(self, env: Any) -> tuple[list[dict[str, Any]], bool]:
        """The env's tools and whether it has a terminal tool: static for an env class (fetched once per
        process from the environment), or asked of each session with ``tools_per_task`` (an env whose
        tools depend on the task: its ``list_task_tools``)."""
        if self.tools_per_task:
            return specs_of(self.session.list_tools()), self.session.terminal_tool() is not None
        key = (self.name, self.base_url, self.variant)
        if key not in _tools:
            _tools[key] = (specs_of(env.list_tools()), env.terminal_tool() is not None)
        return _tools[key]

    def step(self, action: str) -> StepResult:
        from openreward.api.errors import ToolCallError

        if self.session is None or self.done:
            raise EnvStateError("step() called before reset() or after the episode ended")
        parsed = parse_tool_calls(action)
        if not parsed.has_tool_syntax:  # a plain reply: the final answer, or a nudge
            if not self.has_terminal:
                return self._result(self.nudge, [], finished=False, info={})
            out = self.session.call_terminal_tool(parsed.text.strip() or action)
            return self._result(render_blocks(out.blocks), [out.reward], True, out.metadata)  # the rollout's end
        shown, rewards, finished, meta = [], [], False, {}
        shown.extend(f"<tool_error>{e[:ERROR_CHARS]}</tool_error>" for e in parsed.errors)
        self.calls += len(parsed.calls) + len(parsed.errors)
        self.errors += len(parsed.errors)
        for call in parsed.calls:
            try:
                out = self.session.call_tool(call.name, call.arguments)
            except ToolCallError as e:  # the session stays usable: tell the model
                self.errors += 1
                shown.append(f"<tool_error>{e.reason}: {str(e.detail)[:ERROR_CHARS]}</tool_error>")
                continue
            shown.append(f"<tool_response>{render_blocks(out.blocks)}</tool_response>")
            rewards.append(out.reward)
            meta.update(out.metadata or {})
            if out.finished:
                finished = True
                break
        return self._result("\n".join(shown), rewards, finished, meta)

    def _result(self, observation: str, rewards: list[float | None], finished: bool,
                info: dict[str, Any] | None) -> StepResult:
        given = [r for r in rewards if r is not None]
        self.done = finished
        out = {"tool_calls": self.calls, "tool_errors": self.errors,
               **{k: v for k, v in (info or {}).items() if isinstance(v, (int, float, str, bool))}}
        return StepResult(observation, sum(given) if given else None, finished, out)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                session.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a session that died already is closed enough
                pass

    def score_group(self, task: Task, trajectories: list[Any]) -> list[float]:
        """The env's comparative scores of a group's rollouts (its ``score_group``), one per trajectory."""
        from openreward.environments import Message, TextBlock

        env = environment(self.name, self.base_url, self.variant)
        with env.session(split=str(task.data["split"]), index=int(task.data["index"])) as session:
            candidates = [[Message(role=m["role"], blocks=[TextBlock(text=m["content"])]) for m in t.messages
                           if m["role"] in ("user", "assistant")] for t in trajectories]
            return [float(s.reward) for s in session.score_group(candidates)]


register("openreward", OpenRewardEnv)


def make_dataset(out_dir: str | Path, *, environment: str, base_url: str | None = None, variant: str | None = None,
                 splits: dict[str, str] | None = None, limit: int | None = None) -> dict[str, Path]:
    """List the env's tasks per split into JSONL rows ``{id, split, index, **task_spec}``; otray's
    ``train``/``eval`` map onto the env's splits by ``splits`` (default ``train`` -> ``train``,
    ``eval`` -> ``test``, or ``validation`` when the env has no ``test``). Idempotent per directory."""
    handle = globals()["environment"](environment, base_url, variant)
    have = [getattr(s, "name", s) for s in handle.list_splits()]
    mapping = dict(splits or {"train": "train", "eval": "test" if "test" in have else "validation"})
    missing = {k: v for k, v in mapping.items() if v not in have}
    if missing:
        raise ConfigError(f"OpenReward env {environment!r} has splits {have}; the dataset maps {missing} onto "
                          "splits it does not have (set dataset.kwargs.splits)")
    tag = (variant or environment).replace("/", "_")
    paths, built = dataset_paths(out_dir, {k: f"{tag}-{v}.jsonl" for k, v in mapping.items()})
    if built:
        return paths
    for ours, theirs in mapping.items():
        count = handle.num_tasks(theirs) if limit is None else min(limit, handle.num_tasks(theirs))
        tasks = handle.get_task_range(theirs, 0, count)
        with atomic_write(paths[ours]) as f:
            for i, t in enumerate(tasks):
                spec = dict(t.task_spec) if isinstance(t.task_spec, dict) else {"task_spec": t.task_spec}
                f.write(json.dumps({**spec, "id": f"{theirs}-{i}", "split": theirs, "index": i}) + "\n")
    return paths
