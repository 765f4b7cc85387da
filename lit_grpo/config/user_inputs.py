"""What a Python caller hands a run beside its config: rows, functions and objects that a YAML
file cannot hold (`lit_grpo.cookbook.main` passes them; the CLI passes none)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class UserInputs:
    """Each field, when set, takes the place of what the config would build."""

    rows: Optional[list[dict]] = None
    """Training rows, handed to the rollout function exactly as given (before `data.path` and the task's rows)."""
    eval_rows: Optional[list[dict]] = None
    """Held-out rows for the greedy evaluation (`data.eval_rows` of them are scored)."""
    rollout_factory: Optional[Callable[[Any], Callable[..., Awaitable[Any]]]] = None
    """`make_rollout_fn(setup) -> rollout_fn`, instead of `rollout.factory`."""
    rollout_extras: dict = field(default_factory=dict)
    """Merged into `setup.extras` (after `rollout.extras`)."""
    reward_fn: Optional[Callable[[str, dict], Optional[float]]] = None
    """`reward(completion_text, row) -> float | None` for the default rollout and the greedy
    evaluation, instead of `reward.fn` / the task's reward."""
    group_filter: Optional[Callable[[Any], bool]] = None
    """The cookbook's `dynamic_filter_fn(PromptGroup) -> bool`: True keeps the group."""
    evaluation_fn: Optional[Callable[[int, Callable[..., Awaitable[Any]]], Awaitable[Optional[dict]]]] = None
    """The cookbook's `evaluation_fn(step, eval_rollout_fn) -> dict | None` (async); its metrics are logged."""
    evaluation_interval: int = 1
    """Run `evaluation_fn` every this many steps (and after the last)."""
    evaluation_timeout_s: float = 3600.0
    """Deadline of one `evaluation_fn` call: past it the evaluation is cancelled and a warning logged."""
