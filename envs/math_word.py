"""Math word problems: data-dependent, single-turn, answers in ``\\boxed{}``.

``make_dataset(dir)`` writes generated problems (people, items, counts; some
answers are fractions) as train/eval JSONL. The reward is 1.0 when the boxed
answer (else the last number in the reply) equals the exact answer; the parser
(:mod:`envs.answers`) accepts whitespace, thousands separators, decimals, ``a/b``
and LaTeX ``\\frac{a}{b}``.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

from envs.answers import format_number, last_number
from otray.env import Env, StepResult, dataset_paths, register
from otray.types import EnvStateError, Task

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "marbles", "stickers", "pencils"]


def _problem(rng: random.Random) -> tuple[str, Fraction]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        boxes, per, gone = rng.randint(2, 12), rng.randint(3, 40), rng.randint(1, 20)
        return (f"{name} has {boxes} boxes with {per} {item} each and gives away {gone}. "
                f"How many {item} are left?", Fraction(boxes * per - gone))
    if kind == 1:
        total, people = rng.randint(2, 60), rng.randint(2, 9)
        return (f"{name} shares {total} {item} equally among {people} friends. "
                f"How many does each friend get?", Fraction(total, people))
    if kind == 2:
        price, count = rng.randint(105, 2500), rng.randint(2, 9)
        return (f"One crate of {item} costs {price:,} cents. What do {count} crates cost, in cents?",
                Fraction(price * count))
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"{name} had {a} {item} and found {b} more. How many now?", Fraction(a + b)


def make_dataset(out_dir: str | Path, *, seed: int = 0, num_train: int = 4000, num_eval: int = 300) -> dict[str, Path]:
    paths, built = dataset_paths(out_dir, {"train": "train.jsonl", "eval": "eval.jsonl"})
    if built:
        return paths
    seen: set[str] = set()
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < num_train + num_eval:
        question, answer = _problem(rng)
        if question not in seen:  # train and eval never share a problem
            seen.add(question)
            rows.append({"id": f"mw-{len(rows)}", "question": question, "answer": format_number(answer)})
    for split, part in (("eval", rows[:num_eval]), ("train", rows[num_eval:])):
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


class MathWord(Env):
    max_turns = 1
    system_prompt = "Solve the problem. Put the final answer in \\boxed{}."

    def __init__(self, system_prompt: str | None = None):
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self._answer: Fraction | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._answer = Fraction(str(task.data["answer"]))
        return str(task.data["question"]), {}

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise EnvStateError("MathWord.step called before reset (or after the episode ended)")
        answer, self._answer = self._answer, None
        got = last_number(action)
        correct = got == answer
        return StepResult("", 1.0 if correct else 0.0, True,
                          {"correct": correct, "parse_error": got is None, "expected": format_number(answer)})


register("math_word", MathWord)
