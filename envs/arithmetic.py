"""Arithmetic: data-dependent, single-turn. "What is a+b?" -> the number.

Dataset: ``make_dataset(dir)`` writes ``train.parquet`` and ``eval.parquet`` with
disjoint problems (columns ``id``, ``question``, ``answer``). The env rewards 1.0
for a correct final answer (the last integer in the reply); with ``format_reward``
> 0 a reply that is exactly one integer earns that bonus even when wrong.
A reply with no integer earns 0 and ``info["parse_error"] = True``.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from otray.env import Env, StepResult, atomic_write, dataset_paths, register
from otray.types import EnvStateError, Task

_INT = re.compile(r"-?\d+")


def parse_answer(text: str) -> int | None:
    """The last integer in ``text`` (commas inside numbers ignored), or None."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def make_problems(seed: int, max_operand: int = 99, ops: str = "+") -> list[dict[str, Any]]:
    """All distinct problems over [0, max_operand]^2 x ops, shuffled by ``seed``."""
    rows = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and b > a:
                    continue
                value = a + b if op == "+" else a - b if op == "-" else a * b
                rows.append({"question": f"{a}{op}{b}=", "answer": value})
    random.Random(seed).shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = f"arith-{i}"
    return rows


def make_dataset(out_dir: str | Path, *, seed: int = 0, num_eval: int = 500, max_operand: int = 99,
                 ops: str = "+") -> dict[str, Path]:
    """Write disjoint train/eval Parquet splits; returns their paths. Idempotent per arguments."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, built = dataset_paths(out_dir, {"train": "train.parquet", "eval": "eval.parquet"})
    if built:
        return paths
    rows = make_problems(seed, max_operand, ops)
    if num_eval >= len(rows):
        raise ValueError(f"num_eval={num_eval} leaves no training problems (only {len(rows)} exist)")
    pq.write_table(pa.Table.from_pylist(rows[:num_eval]), paths["eval"])
    pq.write_table(pa.Table.from_pylist(rows[num_eval:]), paths["train"])
    return paths


def make_chat_dataset(out_dir: str | Path, *, seed: int = 0, num_eval: int = 500, max_operand: int = 99,
                      ops: str = "+", system_prompt: str | None = None) -> dict[str, Path]:
    """The same disjoint splits as :func:`make_dataset`, as chat conversations for SFT jobs.

    Each ``.jsonl`` row has ``messages``: [system?], user question, assistant answer;
    the eval split holds exactly the problems of :func:`make_dataset`'s eval split.
    """
    import json

    paths, built = dataset_paths(out_dir, {"train": "chat_train.jsonl", "eval": "chat_eval.jsonl"})
    if built:
        return paths
    rows = make_problems(seed, max_operand, ops)
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for split, part in (("eval", rows[:num_eval]), ("train", rows[num_eval:])):
        with atomic_write(paths[split]) as f:
            for r in part:
                msgs = head + [{"role": "user", "content": r["question"]},
                               {"role": "assistant", "content": str(r["answer"])}]
                f.write(json.dumps({"id": r["id"], "messages": msgs}) + "\n")
    return paths


class Arithmetic(Env):
    """Answer an arithmetic question with a number."""

    max_turns = 1

    def __init__(self, format_reward: float = 0.0, system_prompt: str | None = None):
        self.format_reward = format_reward
        self.system_prompt = system_prompt
        self._answer: int | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._answer = int(task.data["answer"])
        return str(task.data["question"]), {}

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise EnvStateError("Arithmetic.step called before reset (or after the episode ended)")
        answer, self._answer = self._answer, None
        got = parse_answer(action)
        correct = got == answer
        reward = 1.0 if correct else 0.0
        if self.format_reward and re.fullmatch(r"\s*-?\d+\s*", action):
            reward += self.format_reward
        return StepResult("", reward, True, {"correct": correct, "parse_error": got is None, "expected": answer})


register("arithmetic", Arithmetic)
