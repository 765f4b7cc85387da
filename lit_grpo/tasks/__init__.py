"""Tasks: each makes dataset rows and names the reward that scores them (a registry, see
`lit_grpo.tasks.registry`). The built-ins are `arithmetic` (the CPU demo), `chat_sums` (two-digit
sums asked a chat model), `gsm8k`, `lookup` (a multi-turn game for IGPO) and `calculator` (problems
answered through a tool).

What the training entry point calls, all from the validated `TrainConfig` (`lit_grpo.tasks.rows` calls
the first two only when `data.path` / `data.eval_path` give no rows of the user's own):

    rows = build_rows(c); eval_rows = build_eval_rows(c); reward = reward_fn(c)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, cast

from lit_grpo.config import TrainConfig
from lit_grpo.config.model import TEXT_BUILT_KINDS
from lit_grpo.tasks import arithmetic, calculator, chat_sums, gsm8k, lookup, vlm_shapes  # noqa: F401  (registers the built-in tasks)
from lit_grpo.tasks.images import messages_have_images, row_has_images
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
from lit_grpo.tasks.rows import (
    DEFAULT_ROLLOUT,
    RowError,
    RowPromptError,
    check_prompts,
    load_rows,
    prompt_field_of,
    row_label,
)

__all__ = [
    "TASKS", "RewardFn", "TaskSpec", "available_tasks", "build_eval_rows", "build_rows", "check_task",
    "evaluation_rows", "get_task", "register_task", "reward_fn", "source_problems", "task_options", "task_spec",
    "training_rows",
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

    def reward_model() -> RewardFn:
        from lit_grpo.rewards.reward_model import reward_model_reward  # torch and transformers: only when used

        # The prompt the reward model reads is the one the default rollout samples from.
        return cast(RewardFn, reward_model_reward(c.reward, lambda row: row[prompt_field_of(row, c.data.prompt_field)]))

    return build_reward(c.reward, lambda: spec.reward(task_options(c.task)), spec.name, reward_model)


def source_problems(c: TrainConfig) -> list[str]:
    """What the task reads that cannot be reached from here (for `lit_grpo.run.preflight`); nothing
    when `data.path` replaces its rows."""
    data = _task_data(c)
    return [] if data is None else task_spec(c.task).sources(task_options(c.task), data)


# --------------------------------------------------------------------------- the run's rows


def _checked(c: TrainConfig, rows: list[dict], source: str) -> list[dict]:
    if c.rollout.factory == DEFAULT_ROLLOUT:  # another rollout reads whatever fields it likes
        check_prompts(rows, c.data.prompt_field, source)
        if c.model.kind in TEXT_BUILT_KINDS:  # a folder's policy (kind=hf) is known once loaded: its rollout refuses
            _check_no_images(rows, c.data.prompt_field, source, c.model.kind)
        elif c.trainer.strategy == "fsdp2" or (c.trainer.strategy != "auto" and c.model.train_vision):
            _check_images_in_all_or_none(rows, c.data.prompt_field, source, c.trainer.strategy)
    return rows


def _check_images_in_all_or_none(rows: list[dict], prompt_field: Optional[str], source: str, strategy: str) -> None:
    """Under FSDP2 the vision tower's blocks are sharded units that every rank's forward must run
    together, and DDP with a training tower needs every rank's tower in each backward: a rank whose
    batch has no image would leave the others waiting in a collective. So the rows hold images all
    or none; `RowPromptError` naming the first row that differs from row 0."""

    def has_images(row: dict) -> bool:
        value = row.get(prompt_field_of(row, prompt_field))
        return row_has_images(row, value if isinstance(value, list) else None)

    first = has_images(rows[0])
    for i, row in enumerate(rows):
        if has_images(row) != first:
            raise RowPromptError(
                f"trainer.strategy={strategy}: {source}, row {i} ({row_label(row)}) "
                f"{'holds no image' if first else 'holds images'} where row 0 {'does' if first else 'does not'}; "
                "with a vision-language policy every rank's forward runs the vision tower together, so the rows "
                "must hold images all or none (split them into two runs, or train on one process)"
            )


def _check_no_images(rows: list[dict], prompt_field: Optional[str], source: str, kind: str) -> None:
    """A text policy is given no row whose prompt messages hold images (before any model loads);
    `RowPromptError` naming `model.kind` and the first such row."""
    for i, row in enumerate(rows):
        value = row[prompt_field_of(row, prompt_field)]
        if isinstance(value, list) and messages_have_images(value):
            raise RowPromptError(
                f"model.kind={kind} is a text policy, but {source}, row {i} ({row_label(row)}) holds images in its "
                "messages: only a vision-language policy takes them (model.kind=tiny_vlm, or a vision-language "
                "folder with model.kind=hf)"
            )


def training_rows(c: TrainConfig, rows: Optional[list[dict]] = None) -> list[dict]:
    """The run's training rows: `rows` given in Python, else `data.path`, else the task's rows;
    at most `data.max_rows` (0: all). The row dicts themselves are never copied or changed."""
    max_rows = c.data.max_rows
    if rows is not None:
        source = "the rows given to build_run"
    elif c.data.path:
        source = f"data.path={c.data.path}"
        rows = load_rows(c.data.path, split=c.data.split, dataset_config=c.data.dataset_config, max_rows=max_rows)
    else:
        source = f"task {c.task.get('name')!r}"
        rows = build_rows(c)
    rows = list(rows[:max_rows] if max_rows else rows)
    if not rows:
        raise RowError(f"{source}: no training rows")
    return _checked(c, rows, source)


def evaluation_rows(c: TrainConfig, eval_rows: Optional[list[dict]] = None) -> list[dict]:
    """The held-out rows: `eval_rows` given in Python, else the first `data.eval_rows` of
    `data.eval_path`, else the task's (none when `data.eval_rows` is 0)."""
    if eval_rows is not None:
        return _checked(c, list(eval_rows), "the eval_rows given to build_run")
    if c.data.eval_rows == 0:
        return []
    if c.data.eval_path:
        rows = load_rows(
            c.data.eval_path,
            split=c.data.eval_split,
            dataset_config=c.data.dataset_config,
            max_rows=c.data.eval_rows,
            field="data.eval_path",
        )
        return _checked(c, rows, f"data.eval_path={c.data.eval_path}")
    return _checked(c, build_eval_rows(c), f"task {c.task.get('name')!r} (held-out rows)")
