"""The bundled envs, the tool-call format, the answer parsers, the Python sandbox and
the Gymnasium adapter (no Ray)."""

import json
import time
from fractions import Fraction
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.answers import extract_boxed, format_number, last_number, parse_number
from envs.bandit import Bandit
from envs.calculator import CalcError, Calculator, evaluate
from envs.calculator import make_dataset as calc_dataset
from envs.guess_number import GuessNumber, binary_search_dialogue
from envs.math_word import MathWord
from envs.math_word import make_dataset as mw_dataset
from envs.python_tool import MathWithCode, run_python
from otray.env import TaskSource, check_env, make, seed_task
from otray.gym_env import GymnasiumEnv
from otray.tools import ToolCall, format_tool_call, parse_tool_calls
from otray.types import ConfigError, Task

from tests.conftest import ROOT  # noqa: E402 (the repository root)


def call(name, **arguments):
    return format_tool_call(ToolCall(name, arguments))


# --------------------------------------------------------------------------- check_env on every bundled env


def _first(path):
    return Task(**{"id": "t0", "env": "e", "data": json.loads(Path(path).read_text().splitlines()[0])})


def test_check_env_passes_for_every_bundled_env(tmp_path):
    calc = _first(calc_dataset(tmp_path / "calc", num_train=5, num_eval=5)["train"])
    mw = _first(mw_dataset(tmp_path / "mw", num_train=5, num_eval=5)["train"])
    seeded = Task("s0", "e", {"seed": 7})
    check_env(make("arithmetic"), Task("a", "e", {"question": "1+2=", "answer": 3}))
    check_env(MathWord(), mw)
    check_env(Calculator(), calc, actions=[call("calculator", expression=calc.data["expression"]), "42"])
    check_env(MathWithCode(), mw, actions=[call("python", code="print(1)"), "\\boxed{1}"])
    check_env(Bandit(), seeded, actions=["A"])
    check_env(GuessNumber(), seeded, actions=["8", "4", "12"])
    check_env(_lake(), Task("l", "e", {"seed": 0}), actions=["down", "right", "up"], max_steps=100)
    check_env(GymnasiumEnv(Echo(), max_turns=5), Task("x", "e", {}), actions=["hi", "stop"])


# --------------------------------------------------------------------------- envs' behaviour


def test_guess_number_rewards_fewer_turns_and_counts_invalid_guesses():
    env, task = GuessNumber(low=1, high=16, max_turns=5, penalty=0.1), Task("g", "e", {"seed": 3})
    env.reset(task)
    target = env._target
    turns = [m["content"] for m in binary_search_dialogue(target) if m["role"] == "assistant"]
    for i, guess in enumerate(turns):
        r = env.step(guess)
    assert r.done and r.info["correct"] and r.reward == pytest.approx(1 - 0.1 * (len(turns) - 1))
    env.reset(task)
    r = env.step("no idea")
    assert not r.done and "one number from 1 to 16" in r.observation and r.info["invalid_guesses"] == 1
    assert env.step("99").info["invalid_guesses"] == 2
    low = env.step("1")
    assert low.observation in ("higher", "") and (target == 1) == low.done


def test_bandit_regret_and_payoffs():
    env = Bandit(probs=[0.1, 0.9])
    rewards = []
    for s in range(400):
        env.reset(Task("b", "e", {}), seed=s)
        r = env.step("I pick B")
        rewards.append(r.reward)
        assert r.info["regret"] == 0.0 and r.info["correct"]
    assert 0.85 < sum(rewards) / len(rewards) < 0.95
    env.reset(Task("b", "e", {}), seed=0)
    r = env.step("A")
    assert r.info["regret"] == pytest.approx(0.8)
    env.reset(Task("b", "e", {}), seed=0)
    assert env.step("none").info["parse_error"]


def test_calculator_tool_flow_and_errors():
    env = Calculator(max_turns=4)
    env.reset(Task("c", "e", {"question": "What is 12*34+5?", "answer": "413"}))
    r = env.step(call("calculator", expression="12*34+5"))
    assert r.observation == "<tool_response>413</tool_response>" and not r.done
    r = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
                 '<tool_call>{"name": "calc"}</tool_call>')
    assert r.observation.count("<tool_error>") == 2 and "division by zero" in r.observation
    r = env.step("The answer is \\boxed{413}.")
    assert r.done and r.reward == 1.0 and r.info["tool_calls"] == 3 and r.info["tool_errors"] == 2
    env.reset(Task("c", "e", {"question": "q", "answer": "1"}))
    for _ in range(3):
        r = env.step(call("calculator", expression="1"))
    assert not r.done
    r = env.step(call("calculator", expression="1"))
    assert r.done and r.reward == 0.0 and not r.info["correct"]  # max_turns without an answer


def test_math_word_answers_in_many_forms():
    env = MathWord()
    for reply in ["\\boxed{3/4}", "so \\boxed{\\frac{3}{4}}", "\\boxed{ 0.75 }", "it is 3/4", "\\boxed{\\dfrac34}"]:
        env.reset(Task("m", "e", {"question": "q", "answer": "3/4"}))
        assert env.step(reply).reward == 1.0, reply
    env.reset(Task("m", "e", {"question": "q", "answer": "1234"}))
    assert env.step("\\boxed{1,234}").reward == 1.0
    env.reset(Task("m", "e", {"question": "q", "answer": "1234"}))
    assert env.step("\\boxed{1235}").reward == 0.0


def test_math_word_levels_draw_their_numbers_and_an_unknown_level_is_named(tmp_path):
    import json
    import re

    easy = mw_dataset(tmp_path / "easy", level="easy", num_train=200, num_eval=50)
    rows = [json.loads(line) for line in easy["train"].read_text().splitlines()]
    assert len(rows) == 200 and max(int(x) for r in rows for x in re.findall(r"\d+", r["question"])) <= 12
    hard = mw_dataset(tmp_path / "hard", num_train=200, num_eval=50)  # the default: as first built
    assert max(int(x) for line in hard["train"].read_text().splitlines()
               for x in re.findall(r"\d+", json.loads(line)["question"].replace(",", ""))) > 99
    with pytest.raises(ValueError, match="level must be one of hard, easy"):
        mw_dataset(tmp_path / "x", level="medium")


# --------------------------------------------------------------------------- the code tool contains escapes


def test_python_tool_contains_escapes_as_error_observations(tmp_path):
    env = MathWithCode(max_turns=10)
    env.reset(Task("p", "e", {"question": "q", "answer": "42"}))
    target = ROOT / "SANDBOX_ESCAPE.txt"
    attempts = {
        "while True: pass": "CPU time limit",
        "x = bytearray(10 * 1024**3)": "memory limit",
        "import socket\ns = socket.socket()\ns.connect(('93.184.216.34', 80))": "socket",
        f"open({str(target)!r}, 'w').write('x')": "not allowed",
    }
    for code, why in attempts.items():
        r = env.step(call("python", code=code))
        assert not r.done and r.observation.startswith("<tool_error>") and why in r.observation, (code, r.observation)
    assert not target.exists()
    r = env.step(call("python", code="print(6 * 7)"))  # the env still works afterwards
    assert r.observation == "<tool_response>42</tool_response>"
    r = env.step("\\boxed{42}")
    assert r.done and r.reward == 1.0 and r.info["tool_errors"] == 4 and r.info["tool_calls"] == 5


def test_python_tool_output_limit_and_timeout():
    assert "[output truncated at 100 bytes" in run_python("print('x' * 10000)", max_output=100).output
    slow = run_python("import time\ntime.sleep(30)", wall_s=1.0)
    assert not slow.ok and "timed out" in slow.error
    t0 = time.perf_counter()  # a write loop: read up to the cap, then stopped (it used to buffer GBs)
    flood = run_python("while True:\n    print('x' * 100000)", max_output=2000, wall_s=5.0)
    assert time.perf_counter() - t0 < 2.0 and len(flood.output) < 2200 and "truncated" in flood.output


# The escapes the security review used (with the audit hook intact they worked): shell, writes
# through dir_fd, sqlite on the registry, reading the host's files. Run twice: through the tool
# (both layers), and with no audit hook at all (bubblewrap alone must contain them).
ESCAPES = {
    "shell": "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'touch {marker}'], check=True)",
    "dir_fd write": "import os\nfd = os.open({dir!r}, os.O_RDONLY)\nos.open('marker', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
    "sqlite outside": "import sqlite3\nsqlite3.connect({db!r}).execute('create table t(x)')",
    "read the host": "print(open({secret!r}).read())",
    "parent's environ": "import os\nprint(open(f'/proc/{{os.getppid()}}/environ').read())",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
}


def test_python_tool_sandbox_holds_against_deliberate_escapes(tmp_path, monkeypatch):
    import socket

    from otray.sandbox import run_python_sandboxed, sandbox_problem

    assert sandbox_problem() is None, f"bubblewrap must run here (make installs it): {sandbox_problem()}"
    monkeypatch.setenv("OTRAY_SECRET_FOR_TEST", "registry-key")
    listener = socket.create_server(("127.0.0.1", 0))  # a host service the sandbox must not reach
    marker, secret = tmp_path / "marker", tmp_path / "secret.txt"
    secret.write_text("the registry's contents")
    fill = {"marker": marker, "dir": str(tmp_path), "db": str(tmp_path / "registry.db"), "secret": str(secret),
            "port": listener.getsockname()[1]}
    no_hook = "import sys\nexec(compile(sys.stdin.read(), '<code>', 'exec'), {})"
    for name, code in ESCAPES.items():
        via_tool = run_python(code.format(**fill))
        bare = run_python_sandboxed(no_hook, [], code.format(**fill).encode(), wall_s=10, cpu_s=5, memory_mb=512,
                                    file_mb=1, max_output=4000)
        for ok, out in ((via_tool.ok, via_tool.output), (bare.returncode == 0, bare.output.decode())):
            assert "registry" not in out and "connected" not in out, (name, ok, out)
            assert not ok or name == "parent's environ", (name, out)  # that one reads bwrap's own, empty, environ
    listener.close()
    assert not marker.exists() and not (tmp_path / "registry.db").exists()
    # a detached child (new session, parent gone) dies with the sandbox, not 13 s later
    tag = f"30.{time.time_ns() % 10**6:06d}"  # an argument no other process has
    bare = run_python_sandboxed(no_hook, [], (f"import subprocess\nsubprocess.Popen(['/usr/bin/sleep', '{tag}'], "
                                              f"start_new_session=True)\nprint('spawned')").encode(),
                                wall_s=10, cpu_s=5, memory_mb=512, file_mb=1, max_output=4000)
    assert b"spawned" in bare.output
    time.sleep(0.5)
    import psutil

    assert not [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
    # what the sandbox shows: no host directories, the project absent, only its own processes
    seen = run_python("import os\nprint(sorted(os.listdir('/')), os.path.exists({!r}), "
                      "sum(p.isdigit() for p in os.listdir('/proc')))".format(str(ROOT)))
    top, project_visible, pids = seen.output.rsplit(" ", 2)
    assert "sandbox" in top and "home" not in top and project_visible == "False" and int(pids) <= 3, seen.output


# --------------------------------------------------------------------------- Gymnasium adapter


class Echo(gym.Env):
    """A Gymnasium env with Text spaces: reward 1 for saying 'stop', which ends it."""

    observation_space = gym.spaces.Text(64)
    action_space = gym.spaces.Text(64)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return "say something", {}

    def step(self, action):
        return f"you said {action}", float(action == "stop"), action == "stop", False, {}


def _lake():
    return GymnasiumEnv("FrozenLake-v1", make_kwargs={"is_slippery": False}, obs_to_text="envs.frozen_lake:obs_to_text",
                        text_to_action="envs.frozen_lake:text_to_action")


def test_gymnasium_adapter_text_spaces_and_hooks():
    env = GymnasiumEnv(Echo(), max_turns=5)
    assert env.reset(Task("x", "e", {}))[0] == "say something"
    assert env.step("hello").observation == "you said hello"
    r = env.step("é" * 100)  # not in the Text space (charset, length): the env never sees it
    assert not r.done and "Invalid action" in r.observation and r.info["invalid_actions"] == 1
    assert env.step("stop").reward == 1.0
    lake = _lake()
    assert lake.max_turns == 100  # FrozenLake-v1's max_episode_steps
    obs, _ = lake.reset(Task("l", "e", {"seed": 0}))
    assert "row 0, column 0" in obs
    for move in ["right", "right", "down", "down", "down", "right"]:
        r = lake.step(f"I go {move}")
    assert r.done and r.reward == 1.0
    lake.reset(Task("l", "e", {"seed": 0}))
    assert lake.step("jump").info["invalid_actions"] == 1
    with pytest.raises(ConfigError, match="neither gymnasium.spaces.Text nor an image.*give obs_to_text"):
        GymnasiumEnv("FrozenLake-v1")


class Painter(gym.Env):
    """A Gymnasium env whose observations are 8x8 RGB pictures: the image space maps to image parts."""

    observation_space = gym.spaces.Box(0, 255, (8, 8, 3), dtype=np.uint8)
    action_space = gym.spaces.Text(8)

    def reset(self, seed=None, options=None):
        self.shade = 0
        return np.zeros((8, 8, 3), np.uint8), {}

    def step(self, action):
        self.shade += 100
        return np.full((8, 8, 3), self.shade, np.uint8), 1.0, self.shade >= 200, False, {}


def test_gymnasium_image_spaces_become_image_parts():
    from otray.env import check_env
    from otray.vision import Image

    env = GymnasiumEnv(Painter(), max_turns=3, image_prompt="Paint?")
    check_env(env, Task("p", "e", {}), actions=("red",))
    first, _ = env.reset(Task("p", "e", {}))
    assert isinstance(first[0], Image) and first[1] == "Paint?" and first[0].to_pil().getpixel((0, 0)) == (0, 0, 0)
    assert env.step("red").observation[0].to_pil().getpixel((3, 3)) == (100, 100, 100)


def test_generated_tasks_for_data_free_envs():
    a = TaskSource.from_generator(seed_task, 5, "guess", seed=1)
    b = TaskSource.from_generator(seed_task, 5, "guess", seed=1)
    assert [t.data for t in a.tasks] == [t.data for t in b.tasks] and len({t.data["seed"] for t in a.tasks}) == 5


# --------------------------------------------------------------------------- property tests


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_tool_call_parser_never_raises(text):
    parsed = parse_tool_calls(text)
    assert isinstance(parsed.calls, list) and isinstance(parsed.errors, list)


ADVERSARIAL = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", "[", "]",
                               "null", '"', "\\", "<tool_call>{}</tool_call>", "1e999999", "[" * 50])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(ADVERSARIAL, st.text(max_size=5)), max_size=30))
def test_tool_call_parser_on_adversarial_pieces(pieces):
    parse_tool_calls("".join(pieces))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=20).filter(str.strip), st.dictionaries(st.text(max_size=8), JSON, max_size=4),
       st.text(max_size=20), st.text(max_size=20))
def test_well_formed_tool_calls_round_trip(name, arguments, before, after):
    if "<tool_call>" in before + after or "</tool_call>" in before + after:
        return
    parsed = parse_tool_calls(before + format_tool_call(ToolCall(name, arguments)) + after)
    assert parsed.errors == [] and parsed.calls == [ToolCall(name, arguments)] and parsed.text == before + after


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_answer_extractors_never_raise(text):
    extract_boxed(text)
    parse_number(text)
    last_number(text)


@settings(max_examples=300, deadline=None)
@given(st.fractions(max_denominator=1000).filter(lambda f: abs(f) < 10**9))
def test_numbers_round_trip_through_every_written_form(value):
    assert parse_number(format_number(value)) == value
    assert last_number(f"so the answer is \\boxed{{{format_number(value)}}}.") == value
    if value.denominator > 1:
        sign = "-" if value < 0 else ""
        assert parse_number(f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}") == value
    else:
        assert parse_number(f" {int(value):,} ") == value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_calculator_only_raises_calc_errors(text):
    try:
        evaluate(text)
    except CalcError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-999, 999), min_size=1, max_size=6), st.lists(st.sampled_from("+-*"), min_size=5, max_size=5))
def test_calculator_matches_exact_arithmetic(nums, ops):
    # left-to-right with * binding tighter, computed by hand
    text = str(nums[0])
    terms, current = [], Fraction(nums[0])
    for n, op in zip(nums[1:], ops):
        text += f"{op}({n})"
        if op == "*":
            current *= n
        else:
            terms.append(current)
            current = Fraction(n) if op == "+" else Fraction(-n)
    expected = sum(terms, Fraction(0)) + current
    assert evaluate(text) == expected
