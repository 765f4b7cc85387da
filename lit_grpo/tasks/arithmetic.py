"""The arithmetic task of the CPU demo: `a+b=` prompts with a known answer, generated from a seed.

Rows are plain-text prompts (`prompt`, tokenized by the default rollout with the policy's
tokenizer) and carry the reference `answer`, scored by the registered `arithmetic` reward.
Difficulty: operands in 0..max_operand, answers in
0..max_answer; the default (sums of digits below 10) is what a random-init 2-layer model learns
in a few minutes on a CPU; harder settings (`task.max_answer=18`, `task.operators=+-`) are options.
Held-out rows are drawn the same way from another seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lit_grpo.config import require
from lit_grpo.rewards.registry import get_reward
from lit_grpo.tasks.registry import RewardFn, register_task

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# Held-out rows come from another seed: the same distribution, other draws.
_EVAL_SEED_OFFSET = 1_000_003


@dataclass
class ArithmeticOptions:
    """Options of `task=arithmetic` (`conf/task/arithmetic.yaml`)."""

    num_rows: int = 1000
    """Rows generated (drawn with replacement from every problem in range)."""
    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    max_answer: int = 9
    """Only problems whose answer is in 0..max_answer (9: single-digit answers)."""
    operators: str = "+"
    """Operators to draw from, any of `+-*`."""

    def __post_init__(self) -> None:
        require(self.num_rows >= 1, "task.num_rows", "must be >= 1")
        require(self.max_operand >= 1, "task.max_operand", "must be >= 1")
        require(self.max_answer >= 0, "task.max_answer", "must be >= 0")
        require(
            bool(self.operators) and set(self.operators) <= set(_APPLY),
            "task.operators",
            f"must be a non-empty subset of {''.join(_APPLY)!r}",
        )


def all_problems(opts: ArithmeticOptions) -> list[tuple[int, str, int]]:
    """Every (a, op, b) in range whose answer lies in [0, max_answer]."""
    return [
        (a, op, b)
        for op in opts.operators
        for a in range(opts.max_operand + 1)
        for b in range(opts.max_operand + 1)
        if 0 <= _APPLY[op](a, b) <= opts.max_answer
    ]


def make_rows(opts: ArithmeticOptions, seed: int) -> list[dict]:
    """`opts.num_rows` rows drawn uniformly (with replacement) from `all_problems`."""
    problems = all_problems(opts)
    rng = random.Random(seed)
    rows = []
    for _ in range(opts.num_rows):
        a, op, b = rng.choice(problems)
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))})
    return rows


def train_rows(opts: ArithmeticOptions, *, seed: int, max_rows: int) -> list[dict]:
    rows = make_rows(opts, seed)
    return rows[:max_rows] if max_rows else rows


def held_out_rows(opts: ArithmeticOptions, *, seed: int, count: int) -> list[dict]:
    rows = make_rows(opts, seed + _EVAL_SEED_OFFSET)
    return random.Random(seed).sample(rows, min(count, len(rows)))


def reward(opts: ArithmeticOptions) -> RewardFn:
    """The registered `arithmetic` reward: the completion's leading whole number against the row's `answer`."""
    return get_reward("arithmetic")


register_task("arithmetic", options=ArithmeticOptions, rows=train_rows, eval_rows=held_out_rows, reward=reward)
