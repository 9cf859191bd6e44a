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
from otray.env import Env, StepResult, atomic_write, dataset_paths, register
from otray.types import EnvStateError, Task

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "marbles", "stickers", "pencils"]


# the numbers each kind of problem draws, per level: "hard" (the default) as first built; "easy": one-digit
# operands, what otray's tiny model can learn (at the two-digit sums of the arithmetic demo, worded as a
# problem, it answered 2% after its warm-up and GRPO added nothing: session 39, NOTES.md "Issue 55")
LEVELS = {
    "hard": {"boxes": (2, 12), "per": (3, 40), "gone": (1, 20), "total": (2, 60), "people": (2, 9),
             "price": (105, 2500), "count": (2, 9), "had": (100, 999), "found": (100, 999)},
    "easy": {"boxes": (2, 4), "per": (2, 5), "gone": (1, 3), "total": (2, 12), "people": (2, 4),
             "price": (2, 9), "count": (2, 4), "had": (1, 9), "found": (1, 9)},
}


def _problem(rng: random.Random, level: str = "hard") -> tuple[str, Fraction]:
    n = {k: rng.randint(*span) for k, span in LEVELS[level].items()}
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"{name} has {n['boxes']} boxes with {n['per']} {item} each and gives away {n['gone']}. "
                f"How many {item} are left?", Fraction(n["boxes"] * n["per"] - n["gone"]))
    if kind == 1:
        return (f"{name} shares {n['total']} {item} equally among {n['people']} friends. "
                f"How many does each friend get?", Fraction(n["total"], n["people"]))
    if kind == 2:
        return (f"One crate of {item} costs {n['price']:,} cents. What do {n['count']} crates cost, in cents?",
                Fraction(n["price"] * n["count"]))
    return (f"{name} had {n['had']} {item} and found {n['found']} more. How many now?",
            Fraction(n["had"] + n["found"]))


def make_dataset(out_dir: str | Path, *, seed: int = 0, num_train: int = 4000, num_eval: int = 300,
                 level: str = "hard") -> dict[str, Path]:
    """Train/eval JSONL of generated problems at ``level`` (:data:`LEVELS`); eval never repeats a train problem."""
    if level not in LEVELS:
        raise ValueError(f"math_word level must be one of {', '.join(LEVELS)}; got level={level!r}")
    paths, built = dataset_paths(out_dir, {"train": "train.jsonl", "eval": "eval.jsonl"})
    if built:
        return paths
    seen: set[str] = set()
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < num_train + num_eval:
        question, answer = _problem(rng, level)
        if question not in seen:  # train and eval never share a problem
            seen.add(question)
            rows.append({"id": f"mw-{len(rows)}", "question": question, "answer": format_number(answer)})
    for split, part in (("eval", rows[:num_eval]), ("train", rows[num_eval:])):
        with atomic_write(paths[split]) as f:
            f.write("".join(json.dumps(r) + "\n" for r in part))
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
