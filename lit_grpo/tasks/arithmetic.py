"""The arithmetic task of the CPU demo: `a+b=` prompts with a known answer, generated from a seed.

Rows are token-in (`prompt_token_ids` is filled by the data module with the policy's tokenizer)
and carry the reference `answer`. Difficulty: operands in 0..max_operand, answers in
0..max_answer; the default (sums of digits below 10) is what a random-init 2-layer model learns
in a few minutes on a CPU; harder settings (`data.max_answer=18`, `data.operators=+-`) are options.
"""

from __future__ import annotations

import random

from lit_grpo.config import DataConfig

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def all_problems(cfg: DataConfig) -> list[tuple[int, str, int]]:
    """Every (a, op, b) in range whose answer lies in [0, max_answer]."""
    return [
        (a, op, b)
        for op in cfg.operators
        for a in range(cfg.max_operand + 1)
        for b in range(cfg.max_operand + 1)
        if 0 <= _APPLY[op](a, b) <= cfg.max_answer
    ]


def make_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """`cfg.num_rows` rows drawn uniformly (with replacement) from `all_problems`."""
    problems = all_problems(cfg)
    rng = random.Random(seed)
    rows = []
    for _ in range(cfg.num_rows):
        a, op, b = rng.choice(problems)
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))})
    return rows
