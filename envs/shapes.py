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
"""

from __future__ import annotations

import random
import re
from typing import Any

from otray.env import Env, StepResult, register
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


register("count_shapes", CountShapes)
