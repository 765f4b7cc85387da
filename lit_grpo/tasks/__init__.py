"""Tasks: each makes dataset rows and names the reward that scores them (a registry, see
`lit_grpo.tasks.registry`). The built-ins are `arithmetic` (the CPU demo), `gsm8k`, and `lookup`
(a multi-turn game for IGPO).

What the training entry point calls, all from the validated `TrainConfig` (`lit_grpo.tasks.rows` calls
the first two only when `data.path` / `data.eval_path` give no rows of the user's own):

    rows = build_rows(c); eval_rows = build_eval_rows(c); reward = reward_fn(c)
"""

from __future__ import annotations

import dataclasses

from lit_grpo.config import TrainConfig
from lit_grpo.tasks import arithmetic, gsm8k, lookup  # noqa: F401  (registers the built-in tasks)
from lit_grpo.tasks.registry import (
    TASKS,
    RewardFn,
    TaskSpec,
    available_tasks,
    get_task,
    register_task,
    task_options,
    task_spec,
)

__all__ = [
    "TASKS", "RewardFn", "TaskSpec", "available_tasks", "build_eval_rows", "build_rows", "check_task",
    "get_task", "register_task", "reward_fn", "source_problems", "task_options", "task_spec",
]  # fmt: skip


def _task_data(c: TrainConfig):
    """`c.data` as far as the task's rows go: None when `data.path` replaces them all, no evaluation
    when `data.eval_path` replaces its held-out rows."""
    if c.data.path:
        return None
    return dataclasses.replace(c.data, eval_rows=0) if c.data.eval_path else c.data


def check_task(c: TrainConfig) -> None:
    """Validate `c.task` (name, options, and the task's rule with `c.data`); raises `ConfigError`."""
    opts = task_options(c.task)
    if (data := _task_data(c)) is not None:
        task_spec(c.task).check(opts, data)


def build_rows(c: TrainConfig) -> list[dict]:
    """The task's training rows, at most `c.data.max_rows` when that is set. Shape: a list of row dicts."""
    spec, opts = task_spec(c.task), task_options(c.task)
    rows = spec.rows(opts, seed=c.seed, max_rows=c.data.max_rows)
    if not rows:
        raise ValueError(f"task {spec.name!r} produced no rows; check the `task` config")
    return rows[: c.data.max_rows] if c.data.max_rows else rows


def build_eval_rows(c: TrainConfig) -> list[dict]:
    """`c.data.eval_rows` held-out rows for greedy evaluation (none when it is 0)."""
    if c.data.eval_rows == 0:
        return []
    return task_spec(c.task).eval_rows(task_options(c.task), seed=c.seed, count=c.data.eval_rows)


def reward_fn(c: TrainConfig) -> RewardFn:
    """The run's `reward(completion_text, row) -> float | None`: the task's, or `c.reward`'s
    (`lit_grpo.rewards.combine.build_reward`)."""
    from lit_grpo.rewards import build_reward

    spec = task_spec(c.task)
    return build_reward(c.reward, lambda: spec.reward(task_options(c.task)), spec.name)


def source_problems(c: TrainConfig) -> list[str]:
    """What the task reads that cannot be reached from here (for `lit_grpo.run.preflight`); nothing
    when `data.path` replaces its rows."""
    data = _task_data(c)
    return [] if data is None else task_spec(c.task).sources(task_options(c.task), data)
