"""OpenReward environments through otray (envs/openreward.py) against real SDK servers on localhost,
concurrent env calls with time limits, and the episode reward semantics."""

import socket
import time
from pathlib import Path

import pytest

from otray import config
from otray.actors.rollout.agent_loop import AgentLoop, Limits
from otray.actors.rollout.env_io import EnvIO
from otray.env import Env, StepResult, check_env
from otray.types import FinishReason, GenerateResult, Sample, SamplingParams, Task, Trajectory

from tests.conftest import ROOT  # noqa: E402 (the repository root)


@pytest.fixture(scope="module")
def servers():
    """The test envs (Echo first, Faulty, Slow) and the bundled examples, each on its own port."""
    from envs.openreward import start_server

    started = [start_server("tests.fixtures.openreward_envs", cwd=ROOT), start_server("envs.openreward_examples", cwd=ROOT)]
    yield {"tests": started[0][1], "examples": started[1][1]}
    for proc, _ in started:
        proc.terminate()
        proc.wait(10)


def adapter(url, variant, **kw):
    from envs.openreward import OpenRewardEnv

    return OpenRewardEnv(variant, url, variant, **kw)


def task(split="train", index=0):
    return Task(f"{split}-{index}", "or", {"split": split, "index": index})


def call(name, **arguments):
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_check_env_passes_through_the_adapter(servers):
    check_env(adapter(servers["examples"], "ToolAddition"), task(), actions=[call("problem"), "12"])
    check_env(adapter(servers["tests"], "Echo"), task(), actions=[call("say", text="hi"), call("finish", ok=True)])
    check_env(adapter(servers["examples"], "PlainAddition"), task(), actions=["12"])


def test_variant_selects_the_env_on_a_two_env_server(servers):
    env = adapter(servers["tests"], "Faulty")
    assert env.reset(task())[0] == "Faulty task 0" and [t["name"] for t in env.tool_specs] == ["boom", "hang"]
    env.close()
    from envs.openreward import OpenRewardEnv

    first = OpenRewardEnv("Faulty", servers["tests"], None)  # no variant: the server's first env (the SDK's pitfall)
    assert first.reset(task())[0] == "Echo task 0"
    first.close()


def test_tool_errors_are_observations_and_the_episode_goes_on(servers):
    env = adapter(servers["tests"], "Echo")
    env.reset(task())
    unknown = env.step(call("nosuch"))
    assert unknown.observation.startswith("<tool_error>not_found") and not unknown.done and unknown.reward is None
    bad = env.step(call("say", words=3))
    assert bad.observation.startswith("<tool_error>input_validation") and not bad.done
    malformed = env.step("<tool_call>{not json</tool_call>")
    assert "<tool_error>" in malformed.observation and not malformed.done
    plain = env.step("just words")  # no terminal tool: a nudge
    assert "Call one of the tools" in plain.observation and plain.reward is None and not plain.done
    echoed = env.step(call("say", text="hello"))
    assert echoed.observation == "<tool_response>hello</tool_response>" and echoed.reward is None
    done = env.step(call("finish", ok=True))
    assert done.done and done.reward == 1.0 and done.info["tool_calls"] == 5 and done.info["tool_errors"] == 3
    env.close()
    given_up = adapter(servers["tests"], "Echo")
    given_up.reset(task())
    out = given_up.step(call("finish"))
    assert out.done and out.reward is None and out.info["finished"] is False  # ended unfinished by the env
    given_up.close()


def test_the_api_key_never_comes_from_the_config(servers):
    from otray.types import ConfigError

    with pytest.raises(ConfigError, match="OPENREWARD_API_KEY"):
        adapter(servers["tests"], "Echo", api_key="secret")


def scripted(tokenizer, replies: dict[str, str]):
    """A generate function that answers each prompt with the reply of the first key found in its text."""
    from otray.models import end_of_turn_ids

    eos = end_of_turn_ids(tokenizer)[0]

    def generate(prompts, params, n):
        out = []
        for p in prompts:
            text = tokenizer.decode(p)
            reply = next(r for k, r in replies.items() if k in text)
            ids = tokenizer.encode(reply, add_special_tokens=False) + [eos]
            out.append(GenerateResult([Sample(ids, [0.0] * len(ids), FinishReason.STOP)], 0))
        return out
    return generate


def test_a_raising_tool_a_hung_tool_and_a_down_server_are_error_records_and_the_batch_goes_on(servers, tokenizer):
    from envs.openreward import OpenRewardEnv

    gen = scripted(tokenizer, {"Faulty task 0": call("boom"), "Faulty task 1": call("hang"),
                               "Echo task": call("finish", ok=True)})
    io = EnvIO(max_concurrency=8, timeout_s=5.0)  # the SDK retries a refused connection for ~3.5 s
    limits = Limits(max_turns=2, max_tokens_per_turn=64, max_tokens_per_episode=128, max_model_len=512, env_io=io)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    episodes = [(task(index=0), adapter(servers["tests"], "Faulty"), 0),
                (task(index=1), adapter(servers["tests"], "Faulty"), 1),
                (task(index=2), OpenRewardEnv("Echo", dead_url, "Echo"), 2),
                (task(index=3), adapter(servers["tests"], "Echo"), 3)]
    t0 = time.monotonic()
    boom, hang, down, fine = AgentLoop(tokenizer, gen, limits).run_many([(episodes, SamplingParams(max_tokens=64), limits)])
    assert time.monotonic() - t0 < 15  # the hung tool cost its 5 s limit, not the whole batch
    assert boom.error.kind == "env_exception" and "ToolFailed" in boom.error.message
    assert hang.error.kind == "env_timeout" and "5 s" in hang.error.message
    assert down.error.kind == "env_exception" and "MaxRetriesError" in down.error.message and down.num_turns == 0
    assert fine.error is None and fine.finished and fine.turn_rewards == [1.0]


def test_a_turn_cut_at_a_stop_string_keeps_its_text_and_closes_the_turn(servers, tokenizer):
    """The sample ends at </tool_call> with no end-of-turn token: the message keeps the whole call and
    the template's turn close is appended (mask 0) before the tool's answer."""
    from otray.models import end_of_turn_ids

    replies = iter([call("say", text="hi"), call("finish", ok=True)])

    def generate(prompts, params, n):
        ids = tokenizer.encode(next(replies), add_special_tokens=False)
        return [GenerateResult([Sample(ids, [0.0] * len(ids), FinishReason.STOP_STRING)], 0)]

    limits = Limits(max_turns=3, max_tokens_per_turn=64, max_tokens_per_episode=128, max_model_len=512)
    traj, = AgentLoop(tokenizer, generate, limits).run([(task(), adapter(servers["tests"], "Echo"), 0)],
                                                       SamplingParams(max_tokens=64, stop=("</tool_call>",)))
    assert [m["content"] for m in traj.messages if m["role"] == "assistant"] == [call("say", text="hi"),
                                                                                  call("finish", ok=True)]
    first = tokenizer.encode(call("say", text="hi"), add_special_tokens=False)
    start = next(i for i in range(len(traj.token_ids)) if traj.token_ids[i:i + len(first)] == first)
    after = start + len(first)
    assert traj.token_ids[after] == end_of_turn_ids(tokenizer)[0] and traj.loss_mask[after] == 0
    assert traj.finished and traj.turn_rewards == [None, 1.0]


def test_tools_go_to_the_template_when_it_takes_them_else_to_the_system_prompt(servers, tokenizer):
    """The tiny model's template takes no tools=: they are rendered into the system message. A template
    that does take them gets them there (checked with a copy of the tokenizer whose template prints them)."""
    import copy

    gen = scripted(tokenizer, {"": call("finish", ok=True)})
    limits = Limits(max_turns=1, max_tokens_per_turn=64, max_tokens_per_episode=64, max_model_len=512)
    traj, = AgentLoop(tokenizer, gen, limits).run([(task(), adapter(servers["tests"], "Echo"), 0)],
                                                  SamplingParams(max_tokens=64))
    assert traj.messages[0]["role"] == "system" and "- say(text: string): Echo the text." in traj.messages[0]["content"]
    with_tools = copy.deepcopy(tokenizer)
    with_tools.chat_template = ("{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
                                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    traj, = AgentLoop(with_tools, gen, limits).run([(task(), adapter(servers["tests"], "Echo"), 0)],
                                                   SamplingParams(max_tokens=64))
    prompt = with_tools.decode(traj.token_ids[:traj.prompt_len])
    assert prompt.startswith("TOOL finish\nTOOL say\nuser: Echo task 0") and traj.messages[0]["role"] == "user"


def test_chat_demonstrations_show_the_task_as_the_adapter_does(servers, tmp_path):
    import json

    from envs.openreward_examples import make_chat_dataset
    from otray.tools import system_with_tools

    row = json.loads(make_chat_dataset(tmp_path, num_train=3)["train"].read_text().splitlines()[0])
    env = adapter(servers["examples"], "ToolAddition")
    prompt, _ = env.reset(task("train", 0))
    assert [m["content"] for m in row["messages"][:2]] == [system_with_tools(env.tool_specs, env.system_prompt), prompt]
    assert "- problem(): The problem." in row["messages"][0]["content"]
    fetched = env.step(row["messages"][2]["content"])  # the demonstration: fetch the problem, then answer it
    assert fetched.observation == row["messages"][3]["content"] and fetched.reward is None and not fetched.done
    assert env.step(row["messages"][4]["content"]).reward == 1.0
    env.close()
    rows = [json.loads(r) for r in make_chat_dataset(tmp_path / "plain", num_train=3, plain=3)["train"].read_text()
            .splitlines()]
    assert len(rows) == 3 * 4 and rows[1]["messages"] == rows[2]["messages"] == rows[3]["messages"]
    assert rows[1]["messages"][0]["content"] in row["messages"][3]["content"]  # the bare question, 3 times


def test_env_calls_run_concurrently_up_to_max_concurrency(servers, tokenizer):
    """The server counts the tool calls it runs at once: the loop keeps exactly max_concurrency in flight.
    (How much time that saves is measured by benchmarks/env_io.py, not here.)"""
    gen = scripted(tokenizer, {"Slow task": call("wait")})
    probe = adapter(servers["tests"], "Slow")
    probe.reset(task())

    def peak(concurrency: int, n: int) -> int:
        probe.step(call("peak", reset=True))
        limits = Limits(max_turns=3, max_tokens_per_turn=32, max_tokens_per_episode=96, max_model_len=512,
                        env_io=EnvIO(max_concurrency=concurrency))
        eps = [(task(index=i % 20), adapter(servers["tests"], "Slow"), i) for i in range(n)]
        trajs = AgentLoop(tokenizer, gen, limits).run_many([(eps, SamplingParams(max_tokens=32), limits)])
        assert all(t.finished and t.turn_rewards == [None, None, 1.0] for t in trajs)
        return int(probe.step(call("peak")).observation.removeprefix("<tool_response>").removesuffix("</tool_response>"))

    assert peak(1, 4) == 1 and peak(4, 12) == 4 and peak(16, 12) == 12
    probe.close()


# ---------------------------------------------------------------------------- reward semantics


@pytest.mark.parametrize("reduction, expected", [("sum", 1.5), ("mean", 0.75), ("max", 1.0), ("min", 0.5)])
def test_none_rewards_are_left_out_of_each_reduction(reduction, expected):
    from otray.actors.job.episodes import episode_reward

    env = config.EnvSection(entry="x", reward_reduction=reduction)
    assert episode_reward(Trajectory(Task("t", "e"), turn_rewards=[None, 0.5, None, 1.0], finished=True), env) == expected


@pytest.mark.parametrize("reduction, expected", [("sum", 0.5), ("mean", 0.25), ("max", 1.0), ("min", -0.5)])
def test_nonterminal_reward_is_one_more_value_for_an_unfinished_episode(reduction, expected):
    from otray.actors.job.episodes import episode_reward

    env = config.EnvSection(entry="x", reward_reduction=reduction, nonterminal_reward=-0.5)
    unfinished = Trajectory(Task("t", "e"), turn_rewards=[None, 1.0], finished=False)  # ended unfinished, or truncated
    assert episode_reward(unfinished, env) == expected


def test_no_reward_at_all_is_none_and_errors_are_zero():
    from otray.actors.job.episodes import episode_reward
    from otray.types import ErrorRecord

    silent = Trajectory(Task("t", "e"), turn_rewards=[None, None], finished=True)
    assert episode_reward(silent, config.EnvSection(entry="x")) is None
    unfinished = Trajectory(Task("t", "e"), turn_rewards=[None], finished=False)
    assert episode_reward(unfinished, config.EnvSection(entry="x")) == 0.0  # nonterminal_reward 0.0 by default
    assert episode_reward(unfinished, config.EnvSection(entry="x", nonterminal_reward=None)) is None
    errored = Trajectory(Task("t", "e"), turn_rewards=[1.0], error=ErrorRecord("env_exception", "x"))
    assert episode_reward(errored, config.EnvSection(entry="x")) == 0.0


class Flaky(Env):
    """Task ``flaky``: the first ``fails`` resets (counted per class) raise; task ``silent``: finishes
    with reward None; task ``broken``: always raises; anything else: reward 1.0."""

    resets: dict[str, int] = {}
    fails = 2

    def reset(self, task, seed=None):
        n = Flaky.resets[task.id] = Flaky.resets.get(task.id, 0) + 1
        if task.id == "broken" or (task.id == "flaky" and n <= Flaky.fails):
            raise RuntimeError(f"reset {n} of {task.id} failed")
        self.task = task
        return "go", {}

    def step(self, action):
        return StepResult("", None if self.task.id == "silent" else 1.0, True)


def rollouts(tokenizer, retries: int, max_failing: int = 0):
    from otray.actors.job.env_source import EnvRollouts

    Flaky.resets = {}
    cfg = config.load({"envs": {"f": {"entry": "tests.envs.test_openreward:Flaky", "splits": {"train": {"path": "x"}},
                                      "num_rollouts": 2, "max_rollout_retries": retries,
                                      "max_failing_rollouts": max_failing}}})
    return EnvRollouts(cfg, tokenizer, scripted(tokenizer, {"": "ok"}), 128)


def test_failed_rollouts_are_retried_then_taken_out_of_their_group(tokenizer):
    from otray.algos.groups import select_groups

    tasks = [Task(i, "f") for i in ("flaky", "broken", "silent", "fine")]
    flaky, broken, silent, fine = rollouts(tokenizer, retries=1).rollout(tasks, 0, train=True)
    assert [t.reward for t in flaky.trajectories] == [1.0, 1.0] and not flaky.failed  # both reset failures retried
    assert Flaky.resets == {"flaky": 4, "broken": 4, "silent": 4, "fine": 2}  # 2 rollouts + 1 retry each failure
    assert not broken.trajectories and [t.error.kind for t in broken.failed] == ["env_exception"] * 2
    assert not silent.trajectories and [t.error.kind for t in silent.failed] == ["no_reward"] * 2
    assert fine.num_failed == 0 and len(fine.trajectories) == 2
    sel = select_groups([flaky, broken, silent, fine], drop_uniform=False)
    assert sel.kept == [flaky, fine] and sel.failing == [broken, silent]
    # without retries the flaky task's failures are taken out too; max_failing_rollouts=2 keeps the group
    flaky0, *_ = rollouts(tokenizer, retries=0, max_failing=2).rollout(tasks[:1], 0, train=True)
    assert flaky0.num_failed == 2 and not flaky0.trajectories and select_groups([flaky0], False).kept == [flaky0]
    # evaluation keeps every episode as it came (no retry)
    evaluated, = rollouts(tokenizer, retries=1).rollout(tasks[:1], 0, n=1)
    assert evaluated.trajectories[0].error is not None and Flaky.resets == {"flaky": 1}


@pytest.mark.parametrize("mode", ["add", "replace"])
def test_group_scores_combine_with_rollout_rewards(servers, tokenizer, mode):
    from otray.actors.job.env_source import EnvRollouts

    cfg = config.load({"envs": {"echo": {"entry": "openreward", "splits": {"train": {"path": "x"}}, "num_rollouts": 3,
                                         "group_reward": mode, "kwargs": {"environment": "Echo",
                                                                          "base_url": servers["tests"], "variant": "Echo"}}}})
    replies = iter([call("finish", ok=True), call("say", text="x" * 9), call("finish", ok=False)])

    def generate(prompts, params, n):  # the three episodes' first replies, then finish(ok) for the echo one
        out = []
        for p in prompts:
            reply = next(replies, call("finish", ok=True))
            ids = tokenizer.encode(reply, add_special_tokens=False)
            out.append(GenerateResult([Sample(ids, [0.0] * len(ids), FinishReason.LENGTH)], 0))
        return out

    group, = EnvRollouts(cfg, tokenizer, generate, 512).rollout([Task("train-0", "echo", {"split": "train", "index": 0})],
                                                                  0, train=True)
    scores = [t.info["group_score"] for t in group.trajectories]
    assert sorted(scores) == [0.0, 1.0, 2.0]  # rank by length, from the server's score_group
    base = [t.turn_rewards[-1] or 0.0 for t in group.trajectories]
    assert [t.reward for t in group.trajectories] == (
        [b + s for b, s in zip(base, scores)] if mode == "add" else scores)
