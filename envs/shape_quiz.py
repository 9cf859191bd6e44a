"""One shape, one question: single-turn visual tasks that no bundled recipe was tuned on.

Runs in the rollout actors (the env) and the job driver (the task generator). The picture is
56x56 with one filled shape (a square, disc or triangle of size 12-22 in one cell of the 2x2 grid)
and the question asks about one property of it; the answer is the number of a choice:

- ``colour``: "What colour is the shape?" 1 red, 2 green, 3 blue (chance 1/3)
- ``kind``: "Which shape is it?" 1 square, 2 disc, 3 triangle (chance 1/3)
- ``where``: "Where is the shape?" 1 top left, 2 top right, 3 bottom left, 4 bottom right (chance 1/4)
- ``size``: "How big is the shape?" 1 small (12-15 pixels across), 2 medium (16-18), 3 large (19-22)
  (chance ~1/3; neighbouring sizes a pixel apart, and a disc or triangle covers less than a square of its
  size: its warm-ups end at 81-84%, leaving RL room; benchmarks/recipes.py, session 42)

The questions are short on purpose: with the choices spelled out in the prompt (59-86 tokens instead of
~40), otray's tiny VLM did not learn any of the three in 400 warm-up steps (held-out 27-33%), though a
linear probe reads all three from its vision tower's features perfectly; the SFT warm-up teaches the
numbering.

Everything comes from ``task.data["seed"]`` (every rollout of a group sees the same picture); the
reply's last integer is the answer (1.0 if it is the right choice, else 0.0). ``blank=True`` shows a
white picture: the control, where nothing but the answers' prior can be learned. Tasks:
``dataset.generator: envs.shape_quiz:quiz_task`` (``question`` in the generator's kwargs too, so the
``answer`` the SFT warm-up trains on is that question's).
"""

from __future__ import annotations

import random
from typing import Any

from envs.answers import last_number
from envs.shapes import draw
from otray.env import Env, StepResult, register
from otray.types import EnvStateError, Task
from otray.vision import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 150, 30), "blue": (30, 60, 220)}
KINDS = ("square", "disc", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
SIZES = {"small": (12, 15), "medium": (16, 18), "large": (19, 22)}  # pixels across, both ends included
QUESTIONS = {
    "colour": "What colour is the shape?",
    "kind": "Which shape is it?",
    "where": "Where is the shape?",
    "size": "How big is the shape?",
}


def quiz_scene(seed: int) -> tuple[int, str, str, int]:
    """``seed``'s shape: (cell 0-3, kind, colour name, size)."""
    rng = random.Random(seed)
    return rng.randrange(4), rng.choice(KINDS), rng.choice(tuple(COLOURS)), rng.randint(12, 22)


def quiz_answer(seed: int, question: str) -> int:
    """The right choice (1-based) for ``question`` about ``seed``'s picture."""
    cell, kind, colour, size = quiz_scene(seed)
    if question == "colour":
        return tuple(COLOURS).index(colour) + 1
    if question == "kind":
        return KINDS.index(kind) + 1
    if question == "size":
        return next(i for i, (lo, hi) in enumerate(SIZES.values(), 1) if lo <= size <= hi)
    return cell + 1


def _check(question: str) -> str:
    if question not in QUESTIONS:
        raise ValueError(f"ShapeQuiz asks one of {', '.join(QUESTIONS)}; got question={question!r}")
    return question


def quiz_task(rng: random.Random, question: str = "colour") -> dict[str, Any]:
    """A task: a seed and the right choice for ``question`` (``answer``)."""
    seed = rng.randrange(2**31)
    return {"seed": seed, "answer": quiz_answer(seed, _check(question))}


class ShapeQuiz(Env):
    """Answer one question about the single shape in a picture."""

    max_turns = 1

    def __init__(self, question: str = "colour", blank: bool = False, system_prompt: str | None = None):
        self.question, self.blank, self.system_prompt = _check(question), blank, system_prompt
        self._answer: int | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
        cell, kind, colour, size = quiz_scene(int(task.data["seed"]))
        self._answer = quiz_answer(int(task.data["seed"]), self.question)
        picture: Image = draw([(cell, kind, COLOURS[colour], size)], self.blank)
        return [picture, QUESTIONS[self.question]], {}

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise EnvStateError("ShapeQuiz.step called before reset (or after the episode ended)")
        answer, self._answer = self._answer, None
        got = last_number(action)
        return StepResult("", 1.0 if got == answer else 0.0, True,
                          {"correct": got == answer, "parse_error": got is None, "expected": answer})


register("shape_quiz", ShapeQuiz)
