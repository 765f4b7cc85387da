"""Two-digit sums asked in words, for a pretrained chat model: "What is A + B? Answer with the number only."

Each row holds the question as a chat `messages` list (one user turn; the default rollout renders it
through the policy's own chat template, its default system prompt included) and the `answer`,
scored by the registered `last_integer` reward (the completion's last whole number), so
"39 + 67 = 106" earns the reward and "The answer is 106 or 107" does not.

The held-out pairs are drawn first, from `task.eval_seed` (the same for every run seed, so runs of
different seeds are scored on the same rows); training rows are drawn from the other pairs with
the run's seed: no held-out pair is ever trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lit_grpo.config import DataConfig, require
from lit_grpo.rewards.registry import get_reward
from lit_grpo.tasks.registry import RewardFn, register_task

QUESTION = "What is {a} + {b}? Answer with the number only."


@dataclass
class ChatSumsOptions:
    """Options of `task=chat_sums` (`conf/task/chat_sums.yaml`)."""

    num_rows: int = 4096
    """Training rows, drawn with replacement from the pairs not held out."""
    low: int = 10
    """Operands are drawn from low..high (10..99: two-digit sums)."""
    high: int = 99
    """The largest operand."""
    held_out_pairs: int = 1000
    """Pairs (A, B) set aside for evaluation, never trained on; `data.eval_rows` reads the first of them."""
    eval_seed: int = 20261129
    """The seed the held-out pairs are drawn with (not the run's: every run scores the same rows)."""

    def __post_init__(self) -> None:
        require(self.num_rows >= 1, "task.num_rows", "must be >= 1")
        require(0 <= self.low <= self.high, "task.low", f"must be in 0..task.high ({self.high})")
        pairs = (self.high - self.low + 1) ** 2
        require(
            0 <= self.held_out_pairs < pairs,
            "task.held_out_pairs",
            f"must leave pairs to train on: at most {pairs - 1} of the {pairs} in {self.low}..{self.high}",
        )


def split_pairs(opts: ChatSumsOptions) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(held-out pairs in their drawn order, the training pool): disjoint, together every pair in range."""
    pairs = [(a, b) for a in range(opts.low, opts.high + 1) for b in range(opts.low, opts.high + 1)]
    random.Random(opts.eval_seed).shuffle(pairs)
    return pairs[: opts.held_out_pairs], pairs[opts.held_out_pairs :]


def sum_row(a: int, b: int) -> dict:
    """The row of `a + b`: its chat question and its answer."""
    return {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)}


def train_rows(opts: ChatSumsOptions, *, seed: int, max_rows: int) -> list[dict]:
    pool = split_pairs(opts)[1]
    rng = random.Random(seed)
    count = min(opts.num_rows, max_rows) if max_rows else opts.num_rows
    return [sum_row(*rng.choice(pool)) for _ in range(count)]


def held_out_rows(opts: ChatSumsOptions, *, seed: int, count: int) -> list[dict]:
    return [sum_row(a, b) for a, b in split_pairs(opts)[0][:count]]


def reward(opts: ChatSumsOptions) -> RewardFn:
    """The registered `last_integer` reward: the completion's last whole number against the row's `answer`."""
    return get_reward("last_integer")


def check(opts: ChatSumsOptions, data: DataConfig) -> None:
    """Evaluation reads held-out pairs only: `data.eval_rows` cannot ask for more than are set aside."""
    require(
        data.eval_rows <= opts.held_out_pairs,
        "data.eval_rows",
        f"{data.eval_rows} held-out rows asked for, but task.held_out_pairs={opts.held_out_pairs} are set aside; "
        "raise task.held_out_pairs or lower data.eval_rows",
    )


register_task(
    "chat_sums", options=ChatSumsOptions, rows=train_rows, eval_rows=held_out_rows, reward=reward, check=check
)
