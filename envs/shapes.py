"""Visual shape counting: data-free, single-turn, and the answer is only in the picture.

The env draws 1 to ``max_count`` filled shapes (squares, discs, triangles) of random colours and
sizes, one per cell of a 2x2 grid, in a 56x56 picture, and asks how many there are. The count,
cells, shapes and colours come from ``task.data["seed"]`` (every rollout of a GRPO group sees
the same picture). The reply's last integer is the answer: 1.0 if it is the count, else 0.0
(``info["parse_error"]`` when there is none).

``blank=True`` shows a white picture of the same size instead: the control run of the learning
figure (``benchmarks/vlm_learning.py``), where nothing but the count's prior can be learned.

Tasks: ``dataset.generator: envs.shapes:count_task`` (a seed, and the count as ``answer``, which the
SFT warm-up trains on with ``sft.completion_field: answer``).

:class:`ShapesTimes` is the multi-turn, tool-using member of the family: the same picture, and "multiply
the number of shapes by M" (M of two digits), which a tiny model cannot do in its head: it reads the
count from the picture, calls the calculator (``envs.calculator``'s tool, :mod:`otray.tools` syntax),
and answers with the result. Tasks: ``envs.shapes:times_task`` (``call``: the demonstration of the first
turn's tool call, for the SFT warm-up's ``completion_field``).
"""

from __future__ import annotations

import random
import re
from typing import Any

from fractions import Fraction

from envs.answers import last_number
from envs.calculator import Calculator
from otray.env import Env, StepResult, atomic_write, register
from otray.tools import ToolEnv
from otray.types import EnvStateError, Task
from otray.vision import Image

SIDE = 56
CELL = SIDE // 2  # the tiny VLM merges 28x28 pixels into one token: one cell, one image token
COLOURS = ((220, 30, 30), (30, 150, 30), (30, 60, 220), (230, 160, 0), (150, 40, 180))
_INT = re.compile(r"-?\d+")


def scene(seed: int, max_count: int = 4) -> tuple[int, list[tuple[int, str, tuple[int, int, int], int]]]:
    """The count and the shapes of ``seed``'s picture: (cell index, kind, colour, size) each."""
    rng = random.Random(seed)
    count = rng.randint(1, max_count)
    cells = sorted(rng.sample(range(4), count))
    return count, [(c, rng.choice(("square", "disc", "triangle")), rng.choice(COLOURS), rng.randint(12, 22))
                   for c in cells]


def draw(shapes: list[tuple[int, str, tuple[int, int, int], int]], blank: bool = False) -> Image:
    """The PNG picture of ``shapes`` (white, 56x56)."""
    from PIL import Image as PILImage, ImageDraw

    pic = PILImage.new("RGB", (SIDE, SIDE), (255, 255, 255))
    pen = ImageDraw.Draw(pic)
    for cell, kind, colour, size in ([] if blank else shapes):
        x0 = (cell % 2) * CELL + (CELL - size) // 2
        y0 = (cell // 2) * CELL + (CELL - size) // 2
        box = (x0, y0, x0 + size - 1, y0 + size - 1)
        if kind == "square":
            pen.rectangle(box, fill=colour)
        elif kind == "disc":
            pen.ellipse(box, fill=colour)
        else:
            pen.polygon([(x0 + size // 2, y0), (x0, y0 + size - 1), (x0 + size - 1, y0 + size - 1)], fill=colour)
    return Image.from_pil(pic)


def count_task(rng: random.Random, max_count: int = 4) -> dict[str, Any]:
    """A task: a seed and its picture's count (``answer``)."""
    seed = rng.randrange(2**31)
    return {"seed": seed, "answer": scene(seed, max_count)[0]}


class CountShapes(Env):
    """Count the shapes in a picture."""

    max_turns = 1
    question = "How many shapes are in the picture?"

    def __init__(self, max_count: int = 4, blank: bool = False, system_prompt: str | None = None):
        if not 1 <= max_count <= 4:
            raise ValueError(f"CountShapes draws one shape per cell of a 2x2 grid: max_count must be 1-4, got {max_count}")
        self.max_count, self.blank, self.system_prompt = max_count, blank, system_prompt
        self._count: int | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
        self._count, shapes = scene(int(task.data["seed"]), self.max_count)
        return [draw(shapes, self.blank), self.question], {}

    def step(self, action: str) -> StepResult:
        if self._count is None:
            raise EnvStateError("CountShapes.step called before reset (or after the episode ended)")
        count, self._count = self._count, None
        found = _INT.findall(action)
        got = int(found[-1]) if found else None
        return StepResult("", 1.0 if got == count else 0.0, True,
                          {"correct": got == count, "parse_error": got is None, "expected": count})


def times_task(rng: random.Random, max_count: int = 4) -> dict[str, Any]:
    """A task of :class:`ShapesTimes`: a seed, the multiplier, the answer and the first turn's tool call."""
    seed = rng.randrange(2**31)
    count, multiplier = scene(seed, max_count)[0], rng.randint(11, 99)
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{count}*{multiplier}"}}}}</tool_call>'
    return {"seed": seed, "multiplier": multiplier, "answer": count * multiplier, "call": call}


class ShapesTimes(ToolEnv, Env):
    """Multiply the number of shapes in a picture by a two-digit number, with the calculator's help."""

    system_prompt = Calculator.system_prompt
    tools = Calculator.tools

    def __init__(self, max_turns: int = 3, max_count: int = 4, blank: bool = False, system_prompt: str | None = None):
        self.max_turns, self.max_count, self.blank = max_turns, max_count, blank
        if system_prompt is not None:
            self.system_prompt = system_prompt

    def start(self, task: Task) -> list[Any]:
        count, shapes = scene(int(task.data["seed"]), self.max_count)
        self._answer = Fraction(count * int(task.data["multiplier"]))
        return [draw(shapes, self.blank), f"Multiply the number of shapes by {task.data['multiplier']}."]

    def final(self, text: str) -> tuple[float, dict[str, Any]]:
        got = last_number(text)
        return (1.0 if got == self._answer else 0.0), {"correct": got == self._answer, "parse_error": got is None}


def make_times_chat(out_dir: str, *, seed: int = 0, num_train: int = 2000, num_eval: int = 100) -> dict[str, Any]:
    """Whole :class:`ShapesTimes` episodes as chat JSONL (train/eval), for an SFT warm-up: the picture (as an
    OpenAI ``image_url`` data URL), the tool call, the env's own tool response, the answer."""
    import json

    from otray.env import dataset_paths
    from otray.vision import openai_content

    tag = f"s{seed}_{num_train}_{num_eval}"  # one file per arguments: a smaller set never stands in for a larger
    paths, built = dataset_paths(out_dir, {"train": f"chat_train_{tag}.jsonl", "eval": f"chat_eval_{tag}.jsonl"})
    if built:
        return paths
    rng = random.Random(seed)
    env = ShapesTimes()
    for split, n in (("train", num_train), ("eval", num_eval)):
        with atomic_write(paths[split]) as f:
            for i in range(n):
                task = Task(f"st-{split}-{i}", "shapes_times", times_task(rng))
                first, _ = env.reset(task)
                response = env.step(task.data["call"]).observation
                msgs = [{"role": "system", "content": env.system_prompt},
                        {"role": "user", "content": openai_content(first)},
                        {"role": "assistant", "content": task.data["call"]},
                        {"role": "user", "content": response},
                        {"role": "assistant", "content": str(task.data["answer"])}]
                f.write(json.dumps({"id": task.id, "messages": msgs}) + "\n")
    return paths


register("count_shapes", CountShapes)
register("shapes_times", ShapesTimes)
