"""Tools from MCP servers, callable from synchronous env code, each call under a time limit.

An env names its servers as strings (``mcp_servers`` in its kwargs)::

    stdio:envs.mcp_calc_server          # `python -m envs.mcp_calc_server`, spoken to over stdin/stdout
    http://127.0.0.1:8765/mcp           # a Streamable HTTP server
    cmd:npx -y @modelcontextprotocol/server-filesystem /data     # any command (admins only)

Who may name what (docs/security.md): a ``stdio:MODULE`` is an import path (a bundled module or one an
admin allowed), an ``http(s)://`` address one an admin allowed, and a ``cmd:`` command is for admins only.

:class:`McpToolbox` connects to every server of one env (once per process: connections are shared by
the env's episodes, :func:`toolbox`), lists their tools (a name offered by two servers is a ConfigError)
and calls them through the official ``mcp`` SDK on one event-loop thread. A call gets ``call_timeout_s``;
a server that does not answer in time, or that died (its process exited, its connection closed), raises
:class:`McpServerError`: the env's step fails with the cause and the episode becomes an error record,
never a hung step. The broken connection is dropped and the next episode connects again. A tool that
*ran and failed* (the server's ``isError`` result) is not a server failure: :meth:`McpToolbox.call`
returns it with ``is_error`` and the env shows it to the policy as a ``<tool_error>``.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from otray.loop_thread import submit
from otray.types import ConfigError, OtrayError

SCHEMES = ("stdio:", "http://", "https://", "cmd:")


class McpServerError(OtrayError, RuntimeError):
    """An MCP server could not be reached, died, or did not answer in time."""


@dataclass(frozen=True)
class McpTool:
    """One tool as a server lists it: its name, description and JSON Schema of the arguments."""

    server: str
    name: str
    description: str
    schema: dict[str, Any]

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.schema.get("required") or ())

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(k for k in (self.schema.get("properties") or {}) if k not in self.required)

    def spec(self) -> dict[str, Any]:
        """As ``Env.tool_specs`` (OpenAI function shape)."""
        return {"name": self.name, "description": self.description, "parameters": self.schema}


def check_server(spec: Any) -> str:
    """``spec`` if it is a server string of a known kind, else a ConfigError naming the kinds."""
    if not isinstance(spec, str) or not spec.startswith(SCHEMES) or not spec.split(":", 1)[1].strip("/"):
        raise ConfigError(f"MCP server {spec!r}: give 'stdio:MODULE' (python -m MODULE), an http(s):// URL of a "
                          "Streamable HTTP server, or (admins) 'cmd:COMMAND ARGS'")
    return spec


def _target(spec: str) -> Any:
    """What ``mcp.Client`` connects to for a server string."""
    from mcp import StdioServerParameters

    if spec.startswith("stdio:"):
        return StdioServerParameters(command=sys.executable, args=["-m", spec.removeprefix("stdio:")])
    if spec.startswith("cmd:"):
        argv = shlex.split(spec.removeprefix("cmd:"))
        return StdioServerParameters(command=argv[0], args=argv[1:])
    return spec


class _Connection:
    """One open ``mcp.Client``, held open by a task on the loop until :meth:`close` or the server's end."""

    def __init__(self, spec: str, connect_timeout_s: float):
        self.spec, self.connect_timeout_s = spec, connect_timeout_s
        self.client: Any = None
        self.ready = asyncio.Event()
        self.stop = asyncio.Event()
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._hold())
        try:
            await asyncio.wait_for(self.ready.wait(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            self.task.cancel()
            raise McpServerError(f"MCP server {self.spec!r} did not finish connecting in "
                                 f"{self.connect_timeout_s:g} s") from None
        if self.client is None:
            raise McpServerError(f"MCP server {self.spec!r} could not be started or reached: {_cause(self.error)}")

    async def _hold(self) -> None:
        from mcp import Client

        try:
            async with Client(_target(self.spec)) as client:
                self.client = client
                self.ready.set()
                await self.stop.wait()
        except BaseException as e:  # noqa: BLE001 - kept as the cause of the next failure
            self.error = e
        finally:
            self.client = None if self.error is not None else self.client
            self.ready.set()

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def run(self, make: Any, what: str, timeout_s: float) -> Any:
        """Await ``make(client)`` unless the server ends first or ``timeout_s`` passes."""
        if not self.alive or self.client is None:
            raise McpServerError(f"MCP server {self.spec!r} is gone: {_cause(self.error)}")
        call = asyncio.ensure_future(make(self.client))
        done, _ = await asyncio.wait({call, self.task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if call in done:
            return call.result()
        call.cancel()
        if self.task in done:
            raise McpServerError(f"MCP server {self.spec!r} ended during {what}: {_cause(self.error)}")
        raise McpServerError(f"MCP server {self.spec!r} did not answer {what} within {timeout_s:g} s")

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - a hung server is cancelled below
                self.task.cancel()


def _cause(error: BaseException | None) -> str:
    """The innermost message of an error (anyio wraps transport failures in exception groups)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if error is None:
        return "its connection closed (the process exited or the server hung up)"
    return f"{type(error).__name__}: {error}"[:300]


# --------------------------------------------------------------------------- the toolbox


class McpToolbox:
    """The tools of one or more MCP servers (see the module docstring)."""

    def __init__(self, servers: list[str], call_timeout_s: float = 30.0, connect_timeout_s: float = 30.0):
        if not servers:
            raise ConfigError("mcp_servers is empty: name at least one server")
        self.servers = [check_server(s) for s in servers]
        self.call_timeout_s, self.connect_timeout_s = call_timeout_s, connect_timeout_s
        self._conns: dict[str, _Connection] = {}
        self._tools: dict[str, McpTool] | None = None
        self._lock = threading.Lock()

    def _on_loop(self, coro: Any, timeout_s: float) -> Any:
        future = submit(coro)
        try:
            return future.result(timeout_s + 5)  # the coroutine keeps its own limits; this is a backstop
        except FutureTimeout:
            future.cancel()
            raise McpServerError(f"MCP call did not come back in {timeout_s + 5:g} s") from None

    async def _connection(self, spec: str) -> _Connection:
        conn = self._conns.get(spec)
        if conn is None or not conn.alive:
            conn = self._conns[spec] = _Connection(spec, self.connect_timeout_s)
            await conn.open()
        return conn

    def tools(self) -> dict[str, McpTool]:
        """Every server's tools by name (listed once; again after a server was lost)."""
        with self._lock:
            if self._tools is None:
                self._tools = self._on_loop(self._list(), self.connect_timeout_s + self.call_timeout_s)
            return self._tools

    async def _list(self) -> dict[str, McpTool]:
        out: dict[str, McpTool] = {}
        for spec in self.servers:
            conn = await self._connection(spec)
            listed = await conn.run(lambda c: c.list_tools(), "tools/list", self.call_timeout_s)
            for t in listed.tools:
                if t.name in out:
                    raise ConfigError(f"MCP tool {t.name!r} is offered by both {out[t.name].server!r} and {spec!r}: "
                                      "name servers whose tools do not clash")
                out[t.name] = McpTool(spec, t.name, t.description or "", dict(t.input_schema or {}))
        return out

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Call a tool: (its text, whether the tool reported an error). Raises McpServerError when its
        server is gone or silent past ``call_timeout_s`` (the connection is dropped: the next call or
        episode reconnects)."""
        tool = self.tools()[name]
        try:
            return self._on_loop(self._call(tool, arguments), self.call_timeout_s)
        except McpServerError:
            self.drop(tool.server)
            raise

    async def _call(self, tool: McpTool, arguments: dict[str, Any]) -> tuple[str, bool]:
        from mcp.shared.exceptions import MCPError
        from mcp_types.jsonrpc import CONNECTION_CLOSED

        conn = await self._connection(tool.server)
        what = f"tools/call {tool.name!r}"
        try:
            result = await conn.run(lambda c: c.call_tool(tool.name, arguments), what, self.call_timeout_s)
        except MCPError as e:  # the connection closed under the call, or the server refused the request
            if e.code == CONNECTION_CLOSED:
                raise McpServerError(f"MCP server {tool.server!r} ended during {what}: {e.message}") from None
            return f"{e.message} (MCP error {e.code})", True  # e.g. invalid arguments: the policy's to fix
        return render_content(result.content), bool(result.is_error)

    def drop(self, spec: str) -> None:
        """Close one server's connection (the next use opens a new one) and forget the tool list."""
        with self._lock:
            self._tools = None
            conn = self._conns.pop(spec, None)
        if conn is not None:
            submit(conn.close())

    def close(self) -> None:
        for spec in list(self._conns):
            self.drop(spec)


def render_content(blocks: Any) -> str:
    """A tool result's content blocks as text; other kinds as a visible placeholder."""
    out = []
    for b in blocks or ():
        kind = getattr(b, "type", None)
        out.append(b.text if kind == "text" else f"[{kind} content: not shown to this model]")
    return "\n".join(out)


_boxes: dict[tuple[tuple[str, ...], float, float], McpToolbox] = {}
_boxes_lock = threading.Lock()


def toolbox(servers: list[str], call_timeout_s: float = 30.0, connect_timeout_s: float = 30.0) -> McpToolbox:
    """The process's toolbox for these servers and limits (one set of connections per process)."""
    key = (tuple(servers), float(call_timeout_s), float(connect_timeout_s))
    with _boxes_lock:
        if key not in _boxes:
            _boxes[key] = McpToolbox(list(servers), call_timeout_s, connect_timeout_s)
        return _boxes[key]
