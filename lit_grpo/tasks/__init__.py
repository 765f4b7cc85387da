"""Tasks: each makes dataset rows and names the reward that scores them."""

from __future__ import annotations

from typing import Callable

from lit_grpo.config import DataConfig


def build_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """The task's rows, truncated to `cfg.max_rows` when set."""
    from lit_grpo.tasks import arithmetic

    rows = arithmetic.make_rows(cfg, seed)
    if not rows:
        raise ValueError(f"task {cfg.task!r} produced no rows; check the data config")
    return rows[: cfg.max_rows] if cfg.max_rows else rows


def reward_fn(cfg: DataConfig) -> Callable[[str, dict], float]:
    """`reward(completion_text, row) -> float` of the task."""
    from lit_grpo.rewards.arithmetic import score

    return lambda text, row: score(text, row["answer"])
