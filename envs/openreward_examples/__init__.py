"""Example OpenReward environments, served by the real ``openreward`` SDK, that otray trains on.

Both pose the arithmetic demo's problems (``envs.arithmetic.make_problems``: two-digit
additions; split ``test`` = the demo's 500 eval problems, ``train`` = the rest):

- ``ToolAddition`` (tool use): the problem is only given by the ``problem`` tool (no reward);
  the final plain message is graded by the ``@terminal`` tool ``answer`` (1.0 when right).
  Why this shape: with the answer inside a ``submit`` call's JSON, ~25 tokens after the
  numbers, otray's 4-layer tiny model stayed at 1-3% after 300+ SFT steps (docs/notes/learning.md).
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
from pydantic import BaseModel

from envs.arithmetic import make_problems, parse_answer

NUM_TEST = 500


@lru_cache(maxsize=1)
def _problems() -> dict[str, list[dict[str, Any]]]:
    rows = make_problems(seed=0)
    return {"test": rows[:NUM_TEST], "train": rows[NUM_TEST:]}


PROMPT = "Get the problem from the problem tool, then answer it."


class NoArgs(BaseModel):
    pass


class AnswerArgs(BaseModel):
    text: str


class _Addition(Environment):
    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; this env has train and test")
        return _problems()[split]

    def grade(self, text: str) -> ToolOutput:
        right = parse_answer(text) == int(self.task_spec["answer"])
        return ToolOutput(blocks=[TextBlock(text="correct" if right else "wrong")], reward=1.0 if right else 0.0,
                          finished=True, metadata={"correct": right})


class ToolAddition(_Addition):
    """Two-digit addition whose problem must be fetched with a tool; the final message is graded."""

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=PROMPT)]

    @tool
    async def problem(self, params: NoArgs) -> ToolOutput:
        """The problem."""
        return ToolOutput(blocks=[TextBlock(text=self.task_spec["question"])])

    @terminal
    @tool
    async def answer(self, params: AnswerArgs) -> ToolOutput:
        """The final message, graded."""
        return self.grade(params.text)


class PlainAddition(_Addition):
    """Two-digit addition answered in plain text, graded by a terminal tool."""

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=self.task_spec["question"])]

    @terminal
    @tool
    async def answer(self, params: AnswerArgs) -> ToolOutput:
        """The model's final message, graded."""
        return self.grade(params.text)


ENVIRONMENTS = [ToolAddition, PlainAddition]


def make_chat_dataset(out_dir: str | Path, *, num_train: int | None = None, plain: int = 0) -> dict[str, Path]:
    """SFT demonstrations for ``ToolAddition``, as the agent loop shows the env to the model: the system
    prompt (the tools), the prompt, the ``problem`` call, the tool's answer, and the sum as the final
    message; ``chat_train.jsonl`` from the train split, ``chat_eval.jsonl`` from the test split.
    ``plain``: the train split also holds each problem ``plain`` times as a bare question and its sum
    (a few tokens, against ~200 for a tool conversation), so that the addition is learned on cheap
    rows (``true`` = once).
    Idempotent per directory."""
    from envs.openreward import FINAL_ANSWER, specs_of
    from otray.env import atomic_write, dataset_paths
    from otray.tools import ToolCall, format_tool_call, system_with_tools

    paths, built = dataset_paths(out_dir, {"train": "chat_train.jsonl", "eval": "chat_eval.jsonl"})
    if built:
        return paths
    system = system_with_tools(specs_of(ToolAddition.list_tools().tools), FINAL_ANSWER)  # as the loop renders it
    call = format_tool_call(ToolCall("problem", {}))
    for split, name in (("train", "train"), ("eval", "test")):
        rows = _problems()[name][:num_train] if split == "train" else _problems()[name]
        with atomic_write(paths[split]) as f:
            for r in rows:
                f.write(json.dumps({"id": r["id"], "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": PROMPT},
                    {"role": "assistant", "content": call},
                    {"role": "user", "content": f"<tool_response>{r['question']}</tool_response>"},
                    {"role": "assistant", "content": str(r["answer"])}]}) + "\n")
                for k in range(int(plain) if split == "train" else 0):
                    f.write(json.dumps({"id": f"{r['id']}-plain{k or ''}", "messages": [
                        {"role": "user", "content": r["question"]},
                        {"role": "assistant", "content": str(r["answer"])}]}) + "\n")
    return paths
