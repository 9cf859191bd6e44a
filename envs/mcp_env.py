"""Question answering with tools from MCP servers (``entry: mcp``).

Config::

    envs:
      mcp_calc:
        entry: mcp
        kwargs: {mcp_servers: ["stdio:envs.mcp_calc_server"], max_turns: 3, call_timeout_s: 10}
        dataset: {builder: envs.calculator:make_dataset, dir: .cache/data/calculator}
        timeout_s: 30                   # the env I/O limit of each reset/step (otray/actors/rollout/env_io.py)

Tasks have a ``question`` and an exact ``answer`` (the calculator's datasets fit). The env lists every
tool of its servers (``Env.tool_specs``: the chat template's ``tools=``, else the system prompt); a reply
with ``<tool_call>`` blocks runs them on their servers (:mod:`otray.mcp_tools`), a reply without is the
final answer, worth 1.0 when its last number equals the answer. A tool that fails is a ``<tool_error>``
the policy reads (counted in ``info["tool_errors"]``); a server that dies or does not answer within
``call_timeout_s`` fails the step, and the episode becomes an error record naming the server and why.

Servers: ``stdio:MODULE`` (``python -m MODULE``), an ``http(s)://`` Streamable HTTP URL, or (admins only)
``cmd:COMMAND ARGS``; docs/security.md says who may name which.
"""

from __future__ import annotations

from typing import Any

from envs.answers import ExactAnswer
from otray.env import Env, register
from otray.tools import ToolEnv
from otray.types import ConfigError

SYSTEM_PROMPT = "Use the tools when they help. Give the final answer as a number, without a tool call."


class McpToolEnv(ExactAnswer, ToolEnv, Env):
    """Answer a question with the tools of MCP servers (see the module docstring)."""

    tools: dict[str, Any] = {}

    def __init__(self, mcp_servers: list[str] | None = None, max_turns: int = 3, call_timeout_s: float = 30.0,
                 system_prompt: str | None = SYSTEM_PROMPT, **unknown: Any):
        if unknown:
            raise ConfigError(f"envs.<name>.kwargs: unknown key(s) {sorted(unknown)} for entry mcp; valid: "
                              "mcp_servers, max_turns, call_timeout_s, system_prompt")
        if not mcp_servers:
            raise ConfigError("entry mcp needs kwargs.mcp_servers: a list such as ['stdio:envs.mcp_calc_server']")
        self.use_mcp_servers(list(mcp_servers), call_timeout_s)
        self.max_turns, self.system_prompt = max_turns, system_prompt


register("mcp", McpToolEnv)
