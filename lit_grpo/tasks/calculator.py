"""The calculator task: arithmetic a tiny random-init model cannot do, answerable through a tool.

Each row is a problem `(a+b)%m` with two-digit operands and a one-digit answer (default m = 7: a
blind guess is right about 1 time in 7). The prompt is the problem and a cue, `(37+48)%7?`; the
policy, played by `lit_grpo.envs.calculator`, either answers at once (a digit) or calls the
`calc` tool, whose response is the value; the answer move then only has to repeat it:

    (37+48)%7?                                                      prompt
    <tool_call>{"name": "calc", "arguments": {"expression": "(37+48)%7"}}</tool_call>
                                                                    the call (the policy writes `<`)
    \n1                                                             the tool's response, on its own line
    1                                                               the answer, 1.0 when right (`reward`)

As the lookup game's shown rows do, a fraction `shown_frac` of the rows shows a call already made
and its response in the prompt (answered at once, no decision): they teach a random-init policy
to read a response before it can learn that calling pays. Measured on seed 0: with an answer cue
after the value (`\nv=`, or `<tool_response>v</tool_response>=`) the policy had not learnt to
read it after 200-300 steps; with the answer move right after the value (repeating the last
token) it was reading within 40 and calling within 60. Operands always have two digits, so every
row's layout is the same. Rows carry `prompt`, `expression`, `answer` and `shown`; held-out rows
come from another seed and show nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import random
from dataclasses import dataclass
from typing import Optional

from lit_grpo.config import require
from lit_grpo.rewards.registry import inline_reward
from lit_grpo.tasks.registry import RewardFn, register_task

TOOL = "calc"
"""The tool's name in a call."""
CALL_CUE = "?"
"""Ends the problem: call the tool or answer now."""
CALL_HEAD = '<tool_call>{"name": "calc", "arguments": {"expression": "'
"""A call up to its expression, in the common JSON tool-call format."""
CALL_TAIL = '"}}</tool_call>'
"""A call after its expression."""
_EVAL_SEED_OFFSET = 1_000_003  # held-out rows: the same distribution, other draws

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv,
}  # fmt: skip
_MAX_MAGNITUDE = 10**12  # a result past this is an error, not a long computation


@dataclass
class CalculatorOptions:
    """Options of `task=calculator` (`conf/task/calculator.yaml`)."""

    num_rows: int = 4096
    """Rows generated (each problem drawn at random)."""
    min_operand: int = 10
    """Operands are drawn from min_operand..max_operand; both bounds have two digits, so every
    expression has the same length."""
    max_operand: int = 99
    """See `min_operand`."""
    operators: str = "+"
    """The operators of `a op b` to draw from, any of `+-*`."""
    modulus: int = 7
    """The answer is `(a op b) % modulus`, one digit (2..10). With `+` and 7 the answers are near
    uniform, so a blind guess is right about 1 time in 7 (products are 0 modulo 7 one time in 4)."""
    shown_frac: float = 0.5
    """Fraction of rows whose prompt already holds the call and its response (answered at once):
    they teach a random-init policy to read a response before it can learn to call."""

    def __post_init__(self) -> None:
        require(self.num_rows >= 1, "task.num_rows", "must be >= 1")
        require(
            10 <= self.min_operand <= self.max_operand <= 99,
            "task.min_operand",
            f"need 10 <= min_operand <= max_operand <= 99 (two digits), got {self.min_operand}..{self.max_operand}",
        )
        require(
            bool(self.operators) and set(self.operators) <= set(_OPERATORS),
            "task.operators",
            f"must be a non-empty subset of {''.join(_OPERATORS)!r}",
        )
        require(2 <= self.modulus <= 10, "task.modulus", f"must be in [2, 10] (a one-digit answer), got {self.modulus}")
        require(0.0 <= self.shown_frac <= 1.0, "task.shown_frac", f"must be in [0, 1], got {self.shown_frac}")


def tool_call(expression: str) -> str:
    """The call of `calc` on `expression`, as the policy's call reads in full."""
    return f"{CALL_HEAD}{expression}{CALL_TAIL}"


def tool_response(result: str) -> str:
    """The tool's reply to a call: its value, on a line of its own; the answer move comes right
    after it, so that reading the value is repeating the last token."""
    return f"\n{result}"


def calculate(expression: str) -> Optional[int]:
    """The integer value of an arithmetic expression (`+ - * % //`, parentheses, unary minus), or
    None when it is not one (a name, a call, a float, division by zero, a value too large)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _value(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    return value if abs(value) <= _MAX_MAGNITUDE else None


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if max(abs(left), abs(right)) > _MAX_MAGNITUDE:
            raise ValueError("too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def make_row(rng: random.Random, opts: CalculatorOptions) -> dict:
    """One problem; with probability `shown_frac` its prompt holds the call and the response."""
    a, b = rng.randint(opts.min_operand, opts.max_operand), rng.randint(opts.min_operand, opts.max_operand)
    op = rng.choice(opts.operators)
    expression = f"({a}{op}{b})%{opts.modulus}"
    answer = str(_OPERATORS[op](a, b) % opts.modulus)
    shown = rng.random() < opts.shown_frac
    prompt = f"{expression}{CALL_CUE}" + (tool_call(expression) + tool_response(answer) if shown else "")
    return {"prompt": prompt, "expression": expression, "answer": answer, "shown": shown}


def make_rows(opts: CalculatorOptions, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_row(rng, opts) for _ in range(opts.num_rows)]


def train_rows(opts: CalculatorOptions, *, seed: int, max_rows: int) -> list[dict]:
    rows = make_rows(opts, seed)
    return rows[:max_rows] if max_rows else rows


def held_out_rows(opts: CalculatorOptions, *, seed: int, count: int) -> list[dict]:
    return make_rows(dataclasses.replace(opts, num_rows=count, shown_frac=0.0), seed + _EVAL_SEED_OFFSET)


@inline_reward
def answer_reward(completion_text: str, row: dict) -> float:
    """1.0 when the answer is the row's, else 0.0."""
    return 1.0 if completion_text.strip() == row["answer"] else 0.0


def reward(opts: CalculatorOptions) -> RewardFn:
    return answer_reward


register_task("calculator", options=CalculatorOptions, rows=train_rows, eval_rows=held_out_rows, reward=reward)
