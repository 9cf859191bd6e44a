"""Answer extraction shared by the math envs. Nothing here raises on any input string.

- :func:`extract_boxed`: the content of the last ``\\boxed{...}`` (braces balanced).
- :func:`parse_number`: a number written the way models write them, as an exact
  ``Fraction``: ``1,234``, `` - 7 ``, ``3.50``, ``3/4``, ``\\frac{3}{4}``,
  ``\\dfrac{-3}{4}``, ``-\\frac34``, ``$12``, ``12.``; None when it is not one number.
- :func:`format_number`: the canonical text of a Fraction (``"7"``, ``"3/4"``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUM = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+"
_PLAIN = re.compile(rf"(?:{_NUM})")
_SLASH = re.compile(rf"(?P<a>{_NUM})\s*/\s*(?P<b>{_NUM})")
_FRAC = re.compile(r"(?P<sign>[+-]?)\s*\\[dt]?frac\s*(?:\{(?P<a>[^{}]*)\}|(?P<a1>\d))\s*(?:\{(?P<b>[^{}]*)\}|(?P<b1>\d))")
_ANY = re.compile(rf"(?:{_NUM})\s*/\s*(?:{_NUM})|(?:{_NUM})")  # a fraction a/b, else a number
_MAX_CHARS = 200


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` with balanced braces, else None."""
    if not isinstance(text, str):
        return None
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def _plain(s: str) -> Fraction | None:
    s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str) -> Fraction | None:
    """One number in ``text`` as an exact Fraction, or None (never raises)."""
    if not isinstance(text, str) or len(text) > _MAX_CHARS:
        return None
    s = text.strip().strip("$").strip()
    s = re.sub(r"^\\left\(|\\right\)$", "", s)
    s = s.rstrip(".").strip()
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1].strip()
    if _PLAIN.fullmatch(s):
        return _plain(s)
    m = _SLASH.fullmatch(s)
    if m:
        a, b = _plain(m["a"]), _plain(m["b"])
        return a / b if a is not None and b not in (None, 0) else None
    m = _FRAC.fullmatch(s)
    if m:
        a = parse_number(m["a"] if m["a"] is not None else m["a1"])
        b = parse_number(m["b"] if m["b"] is not None else m["b1"])
        if a is None or b in (None, 0):
            return None
        value = a / b
        return -value if m["sign"] == "-" else value
    return None


def last_number(text: str) -> Fraction | None:
    """The boxed answer if there is one, else the last number (or ``a/b``) in ``text``."""
    if not isinstance(text, str):
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return parse_number(boxed)
    found = _ANY.findall(text[-2000:])
    return parse_number(found[-1]) if found else None


def format_number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


class ExactAnswer:
    """Mixin for tool envs whose task has ``question`` and an exact ``answer``: ``start``
    shows the question, ``final`` rewards 1.0 when the reply's answer equals it."""

    def start(self, task: Any) -> str:
        self._answer = Fraction(str(task.data["answer"]))
        return str(task.data["question"])

    def final(self, text: str) -> tuple[float, dict[str, Any]]:
        got = last_number(text)
        correct = got == self._answer
        return (1.0 if correct else 0.0), {"correct": correct, "parse_error": got is None}
