"""Geometry3K-format problems: data-dependent, single-turn, a figure and a question.

Reads rows in the layout of the Hugging Face ``geometry3k`` release (as OpenTinker's and verl's VLM
examples load it): ``images`` (a list of ``{"bytes": PNG/JPEG, "path": ...}``, or of raw bytes),
``problem`` (text with an ``<image>`` marker where the figure goes; without one, the figures come
first) and ``answer`` (a number, ``a/b``, or another short string). A Parquet file of such rows is a
task source as it is (``splits.train.path: geometry3k_train.parquet``).

The reply's answer is its ``\\boxed{}`` content, else its last number; it earns 1.0 when it equals the
row's answer: numerically within ``rel_tol`` when both are numbers, else as text (spaces ignored).
``make_figures(path)`` writes a small file in this layout (right triangles with labelled legs, the
hypotenuse asked for), for tests and a smoke run without the download.

``geometry_figures`` (:class:`GeometryFigures`) is the data-free sibling: tasks from
:func:`figure_task` (a right triangle's hypotenuse, a rectangle's area or perimeter, a triangle's area
from its base and height), each figure drawn at reset with its two lengths written on it.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from envs.answers import extract_boxed, last_number
from otray.env import Env, StepResult, register
from otray.types import DatasetError, EnvStateError, Task
from otray.vision import IMAGE_MARKER, Image


def row_images(row: dict[str, Any]) -> list[Image]:
    """The row's figures, each checked (:class:`otray.vision.Image`); a DatasetError names a bad row."""
    found = row.get("images")
    if found is None and "image" in row:
        found = [row["image"]]
    if not isinstance(found, list) or not found:
        raise DatasetError(f"Geometry3K row {row.get('id', '?')!r} has no 'images' list (fields: {', '.join(row)})")
    out = []
    for k, item in enumerate(found):
        data = item.get("bytes") if isinstance(item, dict) else item
        try:
            out.append(Image.from_bytes(data))
        except ValueError as e:
            raise DatasetError(f"Geometry3K row {row.get('id', '?')!r}, image {k}: {e}") from None
    return out


def observation(problem: str, images: list[Image]) -> list[Any]:
    """The problem's text with its figures where its ``<image>`` markers are (first, without markers)."""
    pieces = problem.split(IMAGE_MARKER)
    if len(pieces) == 1:
        return [*images, problem]
    if len(pieces) - 1 != len(images):
        raise DatasetError(f"the problem has {len(pieces) - 1} <image> markers but the row {len(images)} images")
    out: list[Any] = []
    for k, text in enumerate(pieces):
        if text:
            out.append(text)
        if k < len(images):
            out.append(images[k])
    return out


def same_answer(reply: str, answer: str, rel_tol: float = 1e-2) -> bool:
    boxed = extract_boxed(reply)
    got, want = last_number(reply), last_number(str(answer))
    if got is not None and want is not None:
        return math.isclose(float(got), float(want), rel_tol=rel_tol, abs_tol=1e-9)
    text = boxed if boxed is not None else reply
    return "".join(text.split()) == "".join(str(answer).split())


class Geometry3K(Env):
    """Answer a geometry question about a figure."""

    max_turns = 1
    system_prompt = "Answer with the final value in \\boxed{}."

    def __init__(self, rel_tol: float = 1e-2, system_prompt: str | None = None):
        self.rel_tol = rel_tol
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self._answer: str | None = None

    def reset(self, task: Task, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
        if "problem" not in task.data or "answer" not in task.data:
            raise DatasetError(f"Geometry3K task {task.id!r} needs 'problem' and 'answer' (fields: {', '.join(task.data)})")
        self._answer = str(task.data["answer"])
        return observation(str(task.data["problem"]), row_images(task.data)), {}

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise EnvStateError("Geometry3K.step called before reset (or after the episode ended)")
        answer, self._answer = self._answer, None
        correct = same_answer(action, answer, self.rel_tol)
        return StepResult("", 1.0 if correct else 0.0, True, {"correct": correct, "expected": answer})


TRIPLES = [(3, 4), (6, 8), (5, 12), (8, 15), (9, 12), (7, 24), (12, 16), (20, 21)]  # right triangles, whole hypotenuses
# what each figure kind asks, and its answer from the two labelled lengths
QUESTIONS = {"hypotenuse": ("Find the hypotenuse of the right triangle.", lambda a, b: math.hypot(a, b)),
             "rectangle_area": ("Find the area of the rectangle.", lambda a, b: a * b),
             "rectangle_perimeter": ("Find the perimeter of the rectangle.", lambda a, b: 2 * (a + b)),
             "triangle_area": ("Find the area of the triangle.", lambda a, b: a * b / 2)}


def figure(kind: str, a: int, b: int, size: int = 112) -> Image:
    """A figure with two labelled lengths: a right triangle (legs ``a`` along the bottom, ``b`` up the left),
    a rectangle (width ``a``, height ``b``) or a triangle with base ``a`` and its dashed height ``b``."""
    from PIL import Image as PILImage, ImageDraw

    pic = PILImage.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(pic)
    lo, hi = size // 10, size - size // 8
    mid = (lo + hi) // 2
    if kind == "hypotenuse":
        pen.polygon([(lo, hi), (hi, hi), (lo, lo)], outline="black")
    elif kind.startswith("rectangle"):
        pen.rectangle([lo, lo + size // 6, hi, hi], outline="black")
    elif kind == "triangle_area":
        pen.polygon([(lo, hi), (hi, hi), (mid + size // 8, lo)], outline="black")
        for y in range(lo, hi, 6):  # the height, dashed
            pen.line([(mid + size // 8, y), (mid + size // 8, min(y + 3, hi))], fill="black")
    else:
        raise ValueError(f"no figure kind {kind!r}; choose one of {sorted(QUESTIONS)}")
    pen.text((mid - 4, hi + 1), str(a), fill="black")
    pen.text((0, mid), str(b), fill="black")
    return Image.from_pil(pic)


def figure_task(rng: random.Random, kinds: tuple[str, ...] = tuple(QUESTIONS)) -> dict[str, Any]:
    """A data-free task: a figure kind and its two lengths (whole-number answers), and the answer."""
    kind = rng.choice(list(kinds))
    a, b = rng.choice(TRIPLES) if kind == "hypotenuse" else (rng.randint(2, 20), rng.randint(2, 20))
    return {"kind": kind, "a": a, "b": b, "answer": f"{QUESTIONS[kind][1](a, b):g}"}


class GeometryFigures(Geometry3K):
    """Geometry3K's question shape without its download: a drawn figure with two labelled lengths
    (:func:`figure`), a question about it and a numeric answer; the reply scored as Geometry3K's."""

    def reset(self, task: Task, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
        missing = [k for k in ("kind", "a", "b") if k not in task.data]
        if missing:
            raise DatasetError(f"geometry figure task {task.id!r} lacks {missing} (make tasks with "
                               "envs.geometry3k:figure_task)")
        kind, a, b = task.data["kind"], int(task.data["a"]), int(task.data["b"])
        if kind not in QUESTIONS:
            raise DatasetError(f"geometry figure task {task.id!r}: no figure kind {kind!r}; one of {sorted(QUESTIONS)}")
        self._answer = f"{QUESTIONS[kind][1](a, b):g}"
        return [figure(kind, a, b), QUESTIONS[kind][0]], {}


def make_figures(path: str | Path, n: int = 8, seed: int = 0) -> Path:
    """A Parquet file of ``n`` Geometry3K-layout rows: a right triangle with its legs labelled, find the hypotenuse."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.choice(TRIPLES[:6])
        rows.append({"id": f"g3k-{i}", "images": [{"bytes": figure("hypotenuse", a, b).data, "path": None}],
                     "problem": f"{IMAGE_MARKER}{QUESTIONS['hypotenuse'][0]}", "answer": str(math.hypot(a, b))})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


register("geometry3k", Geometry3K)
register("geometry_figures", GeometryFigures)
