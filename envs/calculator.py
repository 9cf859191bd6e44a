"""Calculator: data-dependent, multi-turn, tool calling.

The task is an arithmetic expression too big to do in one's head ("What is
347*29+18?"). The policy may call the calculator tool (format in
:mod:`otray.tools`)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "347*29+18"}}</tool_call>

and gets ``<tool_response>10081</tool_response>`` back as the next user message.
A reply without tool-call syntax is the final answer: the last number in it (or
the content of ``\\boxed{}``) earns reward 1.0 when correct. A malformed call or a
bad expression gets a ``<tool_error>`` observation and is counted in
``info["tool_errors"]``; the episode goes on until ``max_turns``.

The expression evaluator is a small recursive-descent parser over exact
fractions (``+ - * / ^``, parentheses, unary minus), never Python's ``eval``, with
limits on length, exponent size and number size.
"""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path
from typing import Any

from envs.answers import ExactAnswer, format_number
from otray.env import Env, atomic_write, dataset_paths, register
from otray.tools import Tool, ToolEnv, ToolFailure
from otray.types import OtrayError

MAX_EXPR_CHARS = 200
MAX_EXPONENT = 64
MAX_BITS = 4096


class CalcError(OtrayError, ValueError):
    """An expression the calculator cannot evaluate; the message says why."""


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := '-' unary | power ; power := atom ('^' unary)? ; atom := number | '(' expr ')'"""

    def __init__(self, text: str):
        self.s, self.i = text.replace(" ", "").replace("**", "^").replace("×", "*").replace("÷", "/"), 0

    def parse(self) -> Fraction:
        if not self.s:
            raise CalcError("empty expression")
        value = self.expr()
        if self.i != len(self.s):
            raise CalcError(f"unexpected {self.s[self.i]!r} at position {self.i}")
        return value

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-") and self.peek():
            op = self.s[self.i]
            self.i += 1
            value = _checked(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/") and self.peek():
            op = self.s[self.i]
            self.i += 1
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = _checked(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.i += 1
            return -self.unary()
        if self.peek() == "+":
            self.i += 1
            return self.unary()
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() == "^":
            self.i += 1
            exp = self.unary()
            if exp.denominator != 1 or abs(exp) > MAX_EXPONENT:
                raise CalcError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
            if base == 0 and exp < 0:
                raise CalcError("division by zero")
            return _checked(base ** int(exp))
        return base

    def atom(self) -> Fraction:
        if self.peek() == "(":
            self.i += 1
            value = self.expr()
            if self.peek() != ")":
                raise CalcError("missing ')'")
            self.i += 1
            return value
        start = self.i
        while self.peek() and (self.peek().isdigit() or self.peek() in ".,"):
            self.i += 1
        token = self.s[start:self.i].replace(",", "")
        if not token:
            raise CalcError(f"expected a number at position {start}" + (f", got {self.peek()!r}" if self.peek() else ""))
        try:
            return Fraction(token)
        except ValueError:
            raise CalcError(f"{token!r} is not a number") from None


def _checked(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise CalcError("number too large")
    return value


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; CalcError (with the reason) otherwise."""
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        return _Parser(expression).parse()
    except RecursionError:
        raise CalcError("expression nested too deeply") from None


def make_problems(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` expressions ``a*b+c`` / ``a*b-c`` with 2-3 digit operands, and their values."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(10, 999)
        op = rng.choice("+-")
        expr = f"{a}*{b}{op}{c}"
        rows.append({"id": f"calc-{seed}-{i}", "question": f"What is {expr}?", "expression": expr,
                     "answer": format_number(evaluate(expr))})
    return rows


def make_dataset(out_dir: str | Path, *, seed: int = 0, num_train: int = 5000, num_eval: int = 300) -> dict[str, Path]:
    """Train and eval JSONL splits (disjoint seeds)."""
    import json

    paths, built = dataset_paths(out_dir, {"train": "train.jsonl", "eval": "eval.jsonl"})
    if built:
        return paths
    for split, rows in (("train", make_problems(seed, num_train)), ("eval", make_problems(seed + 10_000, num_eval))):
        with atomic_write(paths[split]) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def make_chat(out_dir: str | Path, *, seed: int = 0, num_train: int = 2000, num_eval: int = 100) -> dict[str, Path]:
    """Whole :class:`Calculator` episodes as chat JSONL (train/eval), for an SFT warm-up: the question, the
    tool call with the question's expression, the env's own tool response, the answer. Drawn with seeds apart
    from :func:`make_dataset`'s, and without its eval split's expressions (same ``seed``)."""
    import json

    from otray.tools import ToolCall, format_tool_call
    from otray.types import Task

    tag = f"s{seed}_{num_train}_{num_eval}"
    paths, built = dataset_paths(out_dir, {"train": f"chat_train_{tag}.jsonl", "eval": f"chat_eval_{tag}.jsonl"})
    if built:
        return paths
    env = Calculator()
    held_out = {r["expression"] for r in make_problems(seed + 10_000, 1000)}  # make_dataset's eval rows
    for split, n, rows_seed in (("train", num_train, seed + 20_000), ("eval", num_eval, seed + 30_000)):
        with atomic_write(paths[split]) as f:
            for row in [r for r in make_problems(rows_seed, n) if r["expression"] not in held_out]:
                first, _ = env.reset(Task(row["id"], "calculator", row))
                call = format_tool_call(ToolCall("calculator", {"expression": row["expression"]}))
                msgs = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first},
                        {"role": "assistant", "content": call}, {"role": "user", "content": env.step(call).observation},
                        {"role": "assistant", "content": row["answer"]}]
                f.write(json.dumps({"id": row["id"], "messages": msgs}) + "\n")
    return paths


def calculator_tool(expression: str) -> str:
    try:
        return format_number(evaluate(expression))
    except CalcError as e:
        raise ToolFailure(str(e)) from None


class Calculator(ExactAnswer, ToolEnv, Env):
    """Answer with the calculator's help; ``max_turns`` bounds tool calls plus the answer."""

    system_prompt = ('Use the calculator by writing <tool_call>{"name": "calculator", "arguments": '
                     '{"expression": "..."}}</tool_call>. Give the final answer as a number.')
    tools = {"calculator": Tool(calculator_tool, ("expression",), "evaluates + - * / ^ and parentheses exactly")}

    def __init__(self, max_turns: int = 3, system_prompt: str | None = None):
        self.max_turns = max_turns
        if system_prompt is not None:
            self.system_prompt = system_prompt


register("calculator", Calculator)
