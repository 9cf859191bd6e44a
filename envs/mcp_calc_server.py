"""A small MCP tool server, bundled so that configs can name it: arithmetic tools over MCP.

Run it over stdio (what ``stdio:envs.mcp_calc_server`` in an env's ``mcp_servers`` does)::

    python -m envs.mcp_calc_server

or, given a port, over Streamable HTTP (the ``python -m MODULE --port P`` shape that
``envs.openreward.start_server`` starts)::

    python -m envs.mcp_calc_server --port 8765     # -> http://127.0.0.1:8765/mcp

Tools: ``calculate(expression)`` (the calculator env's exact evaluator, never Python's ``eval``),
``add(a, b)``, ``multiply(a, b)``. ``sleep(seconds)`` and ``crash()`` exist for tests of hung and dying
servers: a config can only reach them by calling them, and they harm only this server's own process.
"""

from __future__ import annotations

import argparse
import os
import time
from fractions import Fraction

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from envs.answers import format_number
from envs.calculator import CalcError, evaluate

server = MCPServer("otray-calc")


@server.tool()
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / ^ and parentheses) exactly."""
    try:
        return format_number(evaluate(expression))
    except CalcError as e:
        raise ToolError(str(e)) from None  # a tool error (isError) the model reads


@server.tool()
def add(a: float, b: float) -> str:
    """Add two numbers."""
    return format_number(Fraction(str(a)) + Fraction(str(b)))


@server.tool()
def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    return format_number(Fraction(str(a)) * Fraction(str(b)))


@server.tool()
def sleep(seconds: float) -> str:
    """Wait (tests of hung servers)."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """End this server's process at once (tests of dying servers)."""
    os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, help="serve Streamable HTTP on this port (else stdio)")
    args = parser.parse_args()
    if args.port is not None:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
