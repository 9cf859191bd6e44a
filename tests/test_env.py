import json

import pytest

from envs.arithmetic import Arithmetic, make_dataset, parse_answer
from otray.env import Env, Mixture, StepResult, TaskSource, check_env, make
from otray.types import DatasetError, EnvCheckError, EnvStateError, Task

TASK = Task("t", "arithmetic", {"question": "2+3=", "answer": 5})


def test_arithmetic_passes_check_env_and_scores():
    check_env(Arithmetic(), TASK)
    env = Arithmetic(format_reward=0.1)
    env.reset(TASK)
    assert env.step("5").reward == pytest.approx(1.1)
    env.reset(TASK)
    r = env.step("I think 4")
    assert r.reward == 0.0 and r.done and not r.info["correct"]
    env.reset(TASK)
    assert env.step("no idea").info["parse_error"] is True


@pytest.mark.parametrize("text, expected", [("12", 12), ("a 1,234 b", 1234), ("-7", -7), ("x", None), ("1 then 2", 2)])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


class NoResetGuard(Env):
    def reset(self, task, seed=None):
        return "hi", {}

    def step(self, action):
        return StepResult("", 1.0, True)


class _Guarded(Env):
    """Follows the state rules; subclasses break one other rule each."""

    def __init__(self):
        self.started = False

    def reset(self, task, seed=None):
        self.started = True
        return "hi", {}

    def step(self, action):
        if not self.started:
            raise EnvStateError("reset first")
        return self.result()


class BoolReward(_Guarded):
    def result(self):
        self.started = False
        return StepResult("", True, True)


class NeverDone(_Guarded):
    max_turns = 3

    def result(self):
        return StepResult("again", 0.0, False)


@pytest.mark.parametrize("env, match", [
    (NoResetGuard(), "step before reset must raise EnvStateError"),
    (BoolReward(), "reward must be a finite float.*bool"),
    (NeverDone(), "never set done=True within 3 steps"),
])
def test_check_env_reports_broken_envs(env, match):
    with pytest.raises(EnvCheckError, match=match):
        check_env(env, TASK)


def test_task_sources(tmp_path):
    paths = make_dataset(tmp_path / "d", num_eval=50)
    train = TaskSource.from_file(paths["train"], "arithmetic")
    ev = TaskSource.from_file(paths["eval"], "arithmetic", shuffle=False)
    assert len(ev) == 50 and len(train) == 10000 - 50
    assert not {t.data["question"] for t in ev.tasks} & {t.data["question"] for t in train.tasks}
    jl = tmp_path / "x.jsonl"
    jl.write_text("\n".join(json.dumps({"question": f"{i}+0=", "answer": i}) for i in range(5)))
    src = TaskSource.from_file(jl, "arithmetic", limit=3)
    assert len(src) == 3
    gen = TaskSource.from_generator(lambda rng: {"question": "1+1=", "answer": rng.randint(0, 9)}, 4, "arithmetic")
    assert len(gen) == 4


def test_task_source_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="empty"):
        TaskSource.from_file(tmp_path / "empty.jsonl", "e")
    (tmp_path / "bad.jsonl").write_text("{\"a\": 1}\nnot json\n")
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        TaskSource.from_file(tmp_path / "bad.jsonl", "e")
    with pytest.raises(DatasetError, match="does not exist"):
        TaskSource.from_file(tmp_path / "missing.parquet", "e")


def test_sampling_is_seeded_and_resumable():
    tasks = [Task(str(i), "e") for i in range(10)]
    a = TaskSource(tasks, seed=3)
    first = [t.id for t in a.sample(7)]
    pos = a.position
    nxt = [t.id for t in a.sample(8)]  # crosses an epoch boundary
    b = TaskSource(tasks, seed=3)
    assert [t.id for t in b.sample(7)] == first
    c = TaskSource(tasks, seed=3)
    c.seek(pos)
    assert [t.id for t in c.sample(8)] == nxt
    m1 = Mixture({"x": TaskSource(tasks, seed=1), "y": TaskSource(tasks, seed=2)}, {"x": 1, "y": 3}, seed=0)
    m1.sample(5)
    state = m1.state()
    want = [(t.env, t.id) for t in m1.sample(6)]
    m2 = Mixture({"x": TaskSource(tasks, seed=1), "y": TaskSource(tasks, seed=2)}, {"x": 1, "y": 3}, seed=0)
    m2.load_state(state)
    assert [(t.env, t.id) for t in m2.sample(6)] == want


def test_make_by_name_and_import_path():
    assert isinstance(make("arithmetic"), Arithmetic)
    assert isinstance(make("envs.arithmetic:Arithmetic", format_reward=0.5), Arithmetic)


def test_the_readmes_env_example_passes_check_env():
    """The env a newcomer copies from the README is a valid env (check_env runs inside the snippet)."""
    import re

    from tests.conftest import ROOT

    code = re.search(r"```python\n(from otray import Env.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code, "README.md lost its env example"
    exec(compile(code.group(1), "README.md", "exec"), {})


def test_atomic_write_leaves_a_whole_file_or_none(tmp_path):
    """Dataset builders write through atomic_write: a builder that fails leaves no file (the next run builds it
    again), and builders writing the same file at once leave one whole copy, never a mix with NUL holes."""
    import json
    import threading

    from otray.env import atomic_write

    path = tmp_path / "chat_train.jsonl"
    with pytest.raises(ValueError):
        with atomic_write(path) as f:
            f.write('{"id": 1}\n')
            raise ValueError("the builder failed")
    assert not path.exists() and list(tmp_path.iterdir()) == []

    def build(tag):
        with atomic_write(path) as f:
            for i in range(3000):
                f.write(json.dumps({"id": i, "by": tag, "pad": "x" * 50}) + "\n")

    threads = [threading.Thread(target=build, args=(t,)) for t in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3000 and len({r["by"] for r in rows}) == 1 and list(tmp_path.iterdir()) == [path]
