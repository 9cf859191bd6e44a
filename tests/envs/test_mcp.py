"""Tools from MCP servers (otray/mcp_tools.py, ``entry: mcp``) through the official ``mcp`` SDK, against
servers the tests start: the bundled one over stdio and over Streamable HTTP, and failing ones
(tests/fixtures/mcp_servers.py). A server that hangs or dies ends the step with its cause, never hangs
it; a non-admin cannot start a command through a config."""

import sys
import time

import pytest

from envs.mcp_env import McpToolEnv
from envs.openreward import start_server
from otray import config
from otray.actors.rollout.agent_loop import AgentLoop, Limits
from otray.env import check_env, make
from otray.mcp_tools import McpServerError, McpToolbox, toolbox
from otray.tools import ToolCall, format_tool_call
from otray.trust import BUNDLED_MODULES, Caller, ForbiddenConfigError, confine
from otray.types import ConfigError, SamplingParams, Task

pytestmark = pytest.mark.service  # starts MCP servers in other processes
STDIO = "stdio:envs.mcp_calc_server"
TASK = Task("q", "mcp", {"question": "What is 12*7+3?", "answer": "87"})


def call(name, **arguments):
    return format_tool_call(ToolCall(name, arguments))


def fixture_server(mode):
    return f"cmd:{sys.executable} -m tests.fixtures.mcp_servers {mode}"


def test_stdio_server_tools_through_the_env():
    check_env(make("mcp", mcp_servers=[STDIO]), TASK, actions=[call("calculate", expression="12*7+3"), "87"])
    env = McpToolEnv(mcp_servers=[STDIO], max_turns=4)
    first, _ = env.reset(TASK)
    assert first == "What is 12*7+3?"
    specs = {s["name"]: s for s in env.tool_specs}
    assert {"calculate", "add", "multiply"} <= set(specs)
    assert specs["add"]["parameters"]["required"] == ["a", "b"]
    r = env.step(call("calculate", expression="12*7+3") + call("add", a=1, b=2.5) + call("calculate", expression="1/0")
                 + call("add", a=1) + call("nope"))
    replies = r.observation.split("\n")
    assert replies[:2] == ["<tool_response>87</tool_response>", "<tool_response>7/2</tool_response>"]
    assert "division by zero" in replies[2] and replies[2].startswith("<tool_error>")  # the tool's own failure
    assert "takes arguments ['a', 'b']" in replies[3] and "unknown tool 'nope'" in replies[4]
    assert not r.done and r.info["tool_calls"] == 5 and r.info["tool_errors"] == 3
    final = env.step("It is 87.")
    assert final.done and final.reward == 1.0 and final.info["correct"]


def test_streamable_http_server():
    proc, url = start_server("envs.mcp_calc_server")
    try:
        env = McpToolEnv(mcp_servers=[f"{url}/mcp"])
        env.reset(TASK)
        assert env.step(call("multiply", a=6, b=7)).observation == "<tool_response>42</tool_response>"
    finally:
        proc.kill()


def test_a_hung_server_fails_the_step_in_time_and_the_next_episode_reconnects():
    env = McpToolEnv(mcp_servers=[STDIO], call_timeout_s=2)
    env.reset(TASK)
    start = time.monotonic()
    with pytest.raises(McpServerError, match=r"did not answer tools/call 'sleep' within 2 s"):
        env.step(call("sleep", seconds=30))
    assert time.monotonic() - start < 6
    env.reset(TASK)  # a new connection (a new server process)
    assert env.step(call("add", a=2, b=2)).observation == "<tool_response>4</tool_response>"


def test_a_dying_server_fails_the_step_with_its_cause_and_the_next_episode_reconnects():
    env = McpToolEnv(mcp_servers=[STDIO], call_timeout_s=10)
    env.reset(TASK)
    start = time.monotonic()
    with pytest.raises(McpServerError, match="ended during tools/call 'crash'"):
        env.step(call("crash"))
    assert time.monotonic() - start < 5
    env.reset(TASK)
    assert env.step(call("add", a=1, b=1)).observation == "<tool_response>2</tool_response>"


def test_servers_that_never_start_are_error_records_in_the_agent_loop(tiny_path, tokenizer):
    from otray.actors.sampling.rollout import RolloutWorker

    hung = McpToolEnv(mcp_servers=[fixture_server("hang")])
    dead = McpToolEnv(mcp_servers=[fixture_server("exit")])
    hung.use_mcp_servers(hung.mcp_servers, call_timeout_s=1)
    toolbox(list(hung.mcp_servers), 1.0).connect_timeout_s = 2  # (a hung start would take 30 s by default)
    worker = RolloutWorker(tiny_path, "hf", max_model_len=256)
    loop = AgentLoop(tokenizer, worker.generate, Limits(max_turns=2, max_tokens_per_turn=4,
                                                        max_tokens_per_episode=8, max_model_len=256))
    start = time.monotonic()
    t_hung, t_dead = loop.run([(TASK, hung, 0), (TASK, dead, 1)], SamplingParams(max_tokens=4, seed=0))
    assert time.monotonic() - start < 30
    assert t_hung.error is not None and "did not finish connecting in 2 s" in t_hung.error.message
    assert t_dead.error is not None and "could not be started or reached" in t_dead.error.message


def test_tool_names_must_not_clash_and_server_strings_are_checked():
    with pytest.raises(ConfigError, match="'add' is offered by both"):
        McpToolbox([STDIO, fixture_server("clash")]).tools()
    with pytest.raises(ConfigError, match="give 'stdio:MODULE'"):
        McpToolEnv(mcp_servers=["ftp://x"])
    with pytest.raises(ConfigError, match="needs kwargs.mcp_servers"):
        McpToolEnv()


def _mcp_cfg(servers):
    return {"model": {"path": "tiny"}, "envs": {"calc": {
        "entry": "mcp", "kwargs": {"mcp_servers": servers},
        "dataset": {"builder": "envs.calculator:make_dataset", "dir": ".cache/data/calculator"},
        "splits": {"train": {}, "eval": {"shuffle": False}}}}}


def test_a_user_cannot_start_a_command_through_a_config(tmp_path):
    alice, admin = Caller("alice", False), Caller("root", True)
    confine(config.load(_mcp_cfg([STDIO])), alice, BUNDLED_MODULES, tmp_path)  # a bundled server: fine
    for servers, message in ((["cmd:bash -c id"], "only an admin may run"),
                             (["stdio:os"], "not code this cluster lets users run"),
                             (["stdio:planted_by_a_job"], "not code this cluster lets users run"),
                             (["http://10.0.0.1:80/mcp"], "not an address an admin allowed")):
        with pytest.raises(ForbiddenConfigError, match=message):
            confine(config.load(_mcp_cfg(servers)), alice, BUNDLED_MODULES, tmp_path)
        confine(config.load(_mcp_cfg(servers)), admin, BUNDLED_MODULES, tmp_path)  # admins may
