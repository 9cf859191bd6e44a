"""Example OpenReward environments, served by the real ``openreward`` SDK, that otray trains on.

Both pose the arithmetic demo's problems (``envs.arithmetic.make_problems``: two-digit
additions; split ``test`` = the demo's 500 eval problems, ``train`` = the rest):

- ``ToolAddition`` (tool use): the answer must be submitted through the ``submit`` tool,
  which rewards 1.0 when it is right (0.0 when wrong) and ends the episode; an ``add``
  tool returns a sum with no reward. A reply that calls no tool gets a nudge.
- ``PlainAddition`` (terminal tool): the model answers in plain text; the ``@terminal``
  tool ``answer`` grades that final message.

Serve both on localhost (what ``conf/openreward.yaml`` expects, or let the job start it
with ``base_url: local:envs.openreward_examples``)::

    python -m envs.openreward_examples --port 8090

``make_chat_dataset`` writes SFT demonstrations for ``ToolAddition`` rendered exactly as
otray's adapter (``envs/openreward.py``) shows the env to the model.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from openreward.environments import Environment, TextBlock, ToolOutput, terminal, tool
from pydantic import BaseModel, Field

from envs.arithmetic import make_problems, parse_answer

NUM_TEST = 500


@lru_cache(maxsize=1)
def _problems() -> dict[str, list[dict[str, Any]]]:
    rows = make_problems(seed=0)
    return {"test": rows[:NUM_TEST], "train": rows[NUM_TEST:]}


def question(spec: dict[str, Any]) -> str:
    """The prompt text of a task (``ToolAddition``)."""
    return f"{spec['question']} Submit the answer with the submit tool."


class AddArgs(BaseModel):
    a: int = Field(description="first number")
    b: int = Field(description="second number")


class SubmitArgs(BaseModel):
    answer: int = Field(description="the final answer")


class _Addition(Environment):
    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; this env has train and test")
        return _problems()[split]


class ToolAddition(_Addition):
    """Two-digit addition answered through a tool call."""

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=question(self.task_spec))]

    @tool
    async def add(self, params: AddArgs) -> ToolOutput:
        """Add two numbers."""
        return ToolOutput(blocks=[TextBlock(text=str(params.a + params.b))])

    @tool
    async def submit(self, params: SubmitArgs) -> ToolOutput:
        """Submit the final answer; ends the episode."""
        right = params.answer == int(self.task_spec["answer"])
        return ToolOutput(blocks=[TextBlock(text="correct" if right else "wrong")], reward=1.0 if right else 0.0,
                          finished=True, metadata={"correct": right})


class AnswerArgs(BaseModel):
    text: str


class PlainAddition(_Addition):
    """Two-digit addition answered in plain text, graded by a terminal tool."""

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=self.task_spec["question"])]

    @terminal
    @tool
    async def answer(self, params: AnswerArgs) -> ToolOutput:
        """The model's final message, graded."""
        right = parse_answer(params.text) == int(self.task_spec["answer"])
        return ToolOutput(blocks=[TextBlock(text="correct" if right else "wrong")], reward=1.0 if right else 0.0,
                          finished=True, metadata={"correct": right})


ENVIRONMENTS = [ToolAddition, PlainAddition]


def make_chat_dataset(out_dir: str | Path, *, num_train: int | None = None) -> dict[str, Path]:
    """SFT demonstrations for ``ToolAddition``: system prompt (the tools, as the adapter renders them),
    the task's prompt, and the right ``submit`` call; ``chat_train.jsonl`` from the train split,
    ``chat_eval.jsonl`` from the test split. Idempotent per directory."""
    from envs.openreward import tool_specs
    from otray.env import dataset_paths
    from otray.tools import ToolCall, format_tool_call, system_with_tools

    paths, built = dataset_paths(out_dir, {"train": "chat_train.jsonl", "eval": "chat_eval.jsonl"})
    if built:
        return paths
    system = system_with_tools(tool_specs(ToolAddition.list_tools().tools), None)  # as the agent loop renders it
    for split, name in (("train", "train"), ("eval", "test")):
        rows = _problems()[name][:num_train] if split == "train" else _problems()[name]
        with paths[split].open("w") as f:
            for r in rows:
                call = format_tool_call(ToolCall("submit", {"answer": int(r["answer"])}))
                f.write(json.dumps({"id": r["id"], "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": question(r)},
                    {"role": "assistant", "content": call}]}) + "\n")
    return paths
