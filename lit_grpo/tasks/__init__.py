"""Tasks: each makes dataset rows and names the reward that scores them."""

from __future__ import annotations

import random
from typing import Callable

from lit_grpo.config import DataConfig

# Held-out arithmetic rows come from another seed: the same distribution, other draws.
_EVAL_SEED_OFFSET = 1_000_003


def build_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """The task's training rows, truncated to `cfg.max_rows` when set."""
    if cfg.task == "gsm8k":
        from lit_grpo.tasks import gsm8k

        return gsm8k.load_split(cfg, held_out=False)
    from lit_grpo.tasks import arithmetic

    rows = arithmetic.make_rows(cfg, seed)
    if not rows:
        raise ValueError(f"task {cfg.task!r} produced no rows; check the data config")
    return rows[: cfg.max_rows] if cfg.max_rows else rows


def build_eval_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """`cfg.eval_rows` held-out rows for greedy evaluation (none when it is 0)."""
    if cfg.eval_rows == 0:
        return []
    if cfg.task == "gsm8k":
        from lit_grpo.tasks import gsm8k

        return gsm8k.load_split(cfg, held_out=True)
    from lit_grpo.tasks import arithmetic

    rows = arithmetic.make_rows(cfg, seed + _EVAL_SEED_OFFSET)
    return random.Random(seed).sample(rows, min(cfg.eval_rows, len(rows)))


def reward_fn(cfg: DataConfig) -> Callable[[str, dict], float]:
    """`reward(completion_text, row) -> float` of the task."""
    if cfg.task == "gsm8k":
        from lit_grpo.rewards.gsm8k import score
    else:
        from lit_grpo.rewards.arithmetic import score
    return lambda text, row: score(text, row["answer"])
