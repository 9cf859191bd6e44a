"""Tool calling: one documented text format, parsed strictly.

A policy calls a tool by writing, anywhere in its reply::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>

The body is one JSON object with exactly two keys: ``name`` (a non-empty string)
and ``arguments`` (an object). Several calls may appear in one reply. The env
answers each call with ``<tool_response>...</tool_response>`` in the next
observation, or with ``<tool_error>...</tool_error>`` when the call was malformed
or the tool failed; envs count both kinds in ``info``.

Anything not matching this grammar is a *malformed call*, never an exception:
:func:`parse_tool_calls` returns the calls it could read and one error string per
malformed block (an unclosed tag, a body that is not JSON, wrong or extra keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otray.mcp_tools import McpTool, McpToolbox

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedReply:
    """The calls found in one reply, the malformed blocks, and the text outside the tags."""

    calls: list[ToolCall]
    errors: list[str]
    text: str

    @property
    def has_tool_syntax(self) -> bool:
        return bool(self.calls or self.errors)


def render_tools(tools: list[dict[str, Any]]) -> str:
    """Tool specs (OpenAI function shape: ``name``, ``description``, ``parameters`` as JSON Schema) as
    the model reads them when its chat template takes no ``tools=``: one line per tool with its
    arguments, then the call format."""
    lines = []
    for t in tools:
        props = (t.get("parameters") or {}).get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {t['name']}({args}): {(t.get('description') or '').strip()}")
    return ("Tools:\n" + "\n".join(lines) + "\n"
            + 'Call a tool as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.')


def system_with_tools(tools: list[dict[str, Any]] | None, system_prompt: str | None) -> str | None:
    """The system message of an env that lists ``tools`` (``Env.tool_specs``) to a model whose template
    cannot take them: the rendered tools, then the env's own system prompt."""
    parts = [render_tools(tools) if tools else None, system_prompt]
    return "\n".join(p for p in parts if p) or None


def format_tool_call(call: ToolCall) -> str:
    """The canonical text of a call (what :func:`parse_tool_calls` reads back)."""
    return f"{OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}{CLOSE}"


def _read_call(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        return f"the tool call is not valid JSON ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(obj, dict):
        return f"the tool call must be a JSON object, got {type(obj).__name__}"
    if set(obj) != {"name", "arguments"}:
        return f"the tool call needs exactly the keys 'name' and 'arguments', got {sorted(map(str, obj))}"
    if not isinstance(obj["name"], str) or not obj["name"].strip():
        return "the tool call's 'name' must be a non-empty string"
    if not isinstance(obj["arguments"], dict):
        return f"the tool call's 'arguments' must be an object, got {type(obj['arguments']).__name__}"
    return ToolCall(obj["name"], obj["arguments"])


def parse_tool_calls(text: str) -> ParsedReply:
    """Every ``<tool_call>...</tool_call>`` block in ``text``; never raises."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        stray = text.find(CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            errors.append(f"'{CLOSE}' without a matching '{OPEN}'")
            outside.append(text[pos:stray])
            pos = stray + len(CLOSE)
            continue
        if start == -1:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            errors.append(f"'{OPEN}' is never closed with '{CLOSE}'")
            break
        body = text[start + len(OPEN):end]
        if OPEN in body:
            errors.append(f"'{OPEN}' opened again before '{CLOSE}'")
        else:
            got = _read_call(body)
            (calls if isinstance(got, ToolCall) else errors).append(got)  # type: ignore[arg-type]
        pos = end + len(CLOSE)
    return ParsedReply(calls, errors, "".join(outside))


def tool_response(content: str) -> str:
    return f"<tool_response>{content}</tool_response>"


def tool_error(message: str) -> str:
    return f"<tool_error>{message}</tool_error>"


# --------------------------------------------------------------------------- tool-using envs


class ToolFailure(Exception):
    """Raised by a tool function: the message goes back to the policy as a ``<tool_error>``."""


@dataclass
class Tool:
    """A tool the policy may call: ``fn(**arguments) -> str``; ``arguments`` are the required names,
    ``optional`` the names it may also take."""

    fn: Any
    arguments: tuple[str, ...]
    description: str = ""
    optional: tuple[str, ...] = ()

    def spec(self, name: str) -> dict[str, Any]:
        """As ``Env.tool_specs`` (OpenAI function shape; argument types unknown: strings)."""
        props = {a: {"type": "string"} for a in (*self.arguments, *self.optional)}
        return {"name": name, "description": self.description,
                "parameters": {"type": "object", "properties": props, "required": list(self.arguments)}}


class McpFunction:
    """A :class:`Tool` function that calls one MCP tool: the tool's own failure is a
    ``ToolFailure`` (shown to the policy); a lost or silent server raises :class:`McpServerError`."""

    def __init__(self, box: McpToolbox, tool: McpTool):
        self.box, self.tool = box, tool

    def __call__(self, **arguments: Any) -> str:
        text, is_error = self.box.call(self.tool.name, arguments)
        if is_error:
            raise ToolFailure(text)
        return text

    def spec(self) -> dict[str, Any]:
        return self.tool.spec()


def mcp_tools(box: McpToolbox) -> dict[str, Tool]:
    """The toolbox's tools as :class:`Tool` entries for a ToolEnv's ``tools``."""
    return {name: Tool(McpFunction(box, t), t.required, t.description, t.optional) for name, t in box.tools().items()}


class ToolEnv:
    """Base of multi-turn envs where the policy calls tools, then answers.

    Subclasses set ``tools`` and implement ``start(task) -> first message`` and
    ``final(text) -> (reward, info)``. Each turn: a reply with tool-call syntax is
    answered with one ``<tool_response>`` / ``<tool_error>`` per call (malformed
    calls, unknown tools, wrong arguments and :class:`ToolFailure` count in
    ``info["tool_errors"]``); a reply without it is the final answer. Reaching
    ``max_turns`` without an answer ends the episode with reward 0. Mix this into an
    :class:`otray.env.Env` subclass (``class MyEnv(ToolEnv, Env)``).
    """

    tools: dict[str, Tool] = {}
    max_turns: int = 3
    #: MCP servers whose tools join ``tools`` at each reset (:mod:`otray.mcp_tools`; set by
    #: :meth:`use_mcp_servers`). A server that dies or hangs fails the step: an error record.
    mcp_servers: tuple[str, ...] = ()
    mcp_call_timeout_s: float = 30.0

    def use_mcp_servers(self, servers: list[str] | tuple[str, ...], call_timeout_s: float = 30.0) -> None:
        """Take tools from these MCP servers too (``stdio:MODULE``, an http(s) URL, or an admin's ``cmd:``);
        each call within ``call_timeout_s``. The env then lists its tools in ``tool_specs``."""
        from otray.mcp_tools import check_server

        self.mcp_servers = tuple(check_server(s) for s in servers)
        self.mcp_call_timeout_s = float(call_timeout_s)

    def start(self, task: Any) -> str:
        raise NotImplementedError

    def final(self, text: str) -> tuple[float, dict[str, Any]]:
        raise NotImplementedError

    def reset(self, task: Any, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._turn, self._live = 0, True
        self._info: dict[str, Any] = {"tool_calls": 0, "tool_errors": 0}
        if self.mcp_servers:
            from otray.mcp_tools import toolbox

            mcp = mcp_tools(toolbox(list(self.mcp_servers), self.mcp_call_timeout_s))
            self.tools = {**type(self).tools, **mcp}
            self.tool_specs = [t.spec(name) for name, t in type(self).tools.items()] + [
                mcp[name].fn.spec() for name in mcp]
        return self.start(task), {}

    def step(self, action: str):
        from otray.env import StepResult
        from otray.types import EnvStateError

        if not getattr(self, "_live", False):
            raise EnvStateError(f"{type(self).__name__}.step called before reset (or after the episode ended)")
        self._turn += 1
        parsed = parse_tool_calls(action)
        if not parsed.has_tool_syntax:
            reward, info = self.final(action)
            self._live = False
            return StepResult("", reward, True, {**self._info, **info, "turns": self._turn})
        replies = [tool_error(e) for e in parsed.errors]
        self._info["tool_calls"] += len(parsed.errors)  # attempts, malformed ones included
        self._info["tool_errors"] += len(parsed.errors)
        for call in parsed.calls:
            self._info["tool_calls"] += 1
            replies.append(self._run(call))
        if self._turn >= self.max_turns:
            self._live = False
            return StepResult("", 0.0, True, {**self._info, "correct": False, "turns": self._turn})
        return StepResult("\n".join(replies), 0.0, False, {**self._info, "turns": self._turn})

    def _run(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            self._info["tool_errors"] += 1
            return tool_error(f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}")
        given, required = set(call.arguments), set(tool.arguments)
        if not required <= given <= required | set(tool.optional):
            self._info["tool_errors"] += 1
            takes = list(tool.arguments) + [f"{a} (optional)" for a in tool.optional]
            return tool_error(f"{call.name} takes arguments {takes}, got {sorted(call.arguments)}")
        try:
            return tool_response(str(tool.fn(**call.arguments)))
        except ToolFailure as e:
            self._info["tool_errors"] += 1
            return tool_error(str(e))
