"""The task registry: each task makes dataset rows, names its reward, and declares its own options.

A task is registered with an options dataclass (a docstring under each field, checks in its
`__post_init__` raising `ConfigError` that names `task.<field>`). The run config's `task` dict
(`conf/task/<name>.yaml`: `name` plus that task's options) is converted to that dataclass
strictly by `task_options`: a misspelt key, a value of the wrong type or an unknown task name is a
`ConfigError` naming the field, raised while the config is validated, before any model loads.

    register_task("mine", options=MyOptions, rows=my_rows, eval_rows=my_eval_rows, reward=my_reward)

A user's task registered in `my_pkg/my_tasks.py` is chosen with `task.name=my_pkg.my_tasks:mine`
(the module is imported first; see `lit_grpo.registry`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_grpo.config import ConfigError, DataConfig
from lit_grpo.registry import lookup
from lit_grpo.rewards.registry import RewardFn


@dataclass(frozen=True)
class TaskSpec:
    """A registered task. Every callable takes the task's options (an instance of `options`)."""

    name: str
    options: type
    """Dataclass of the task's own options: the keys of the config's `task` group besides `name`."""
    rows: Callable[..., list[dict]]
    """`rows(options, *, seed, max_rows) -> rows`: the training rows (`max_rows` > 0: at most that
    many; a task may stop reading there)."""
    eval_rows: Callable[..., list[dict]]
    """`eval_rows(options, *, seed, count) -> rows`: at most `count` (> 0) held-out rows."""
    reward: Callable[[Any], RewardFn]
    """`reward(options) -> reward_fn`, with `reward_fn(completion_text, row) -> float | None`."""
    check: Callable[[Any, DataConfig], None]
    """Cross-field rule with the shared data options, run at validation; raises `ConfigError`."""
    sources: Callable[[Any, DataConfig], list[str]]
    """What the run reads that cannot be reached from here (files, hub datasets), one message
    each with the override that points at a local copy; run by `lit_grpo.run.preflight`."""


TASKS: dict[str, TaskSpec] = {}


def register_task(
    name: str,
    *,
    options: type,
    rows: Callable[..., list[dict]],
    eval_rows: Callable[..., list[dict]],
    reward: Callable[[Any], RewardFn],
    check: Optional[Callable[[Any, DataConfig], None]] = None,
    sources: Optional[Callable[[Any, DataConfig], list[str]]] = None,
) -> TaskSpec:
    """Register task `name` (see `TaskSpec` for each argument); `options` must be a dataclass
    whose every field has a default, so that `task.name=<name>` alone is a valid task config."""
    if name in TASKS:
        raise ValueError(f"task {name!r} is already registered")
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"task {name!r}: options must be a dataclass, got {options!r}")
    if "name" in {f.name for f in dataclasses.fields(options)}:
        raise TypeError(f"task {name!r}: an option cannot be called `name` (it selects the task)")
    spec = TaskSpec(
        name=name, options=options, rows=rows, eval_rows=eval_rows, reward=reward,
        check=check or (lambda opts, data: None), sources=sources or (lambda opts, data: []),
    )  # fmt: skip
    TASKS[name] = spec
    return spec


def available_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(TASKS)


def get_task(name: str) -> TaskSpec:
    """The registered task `name` (or `module.path:name`, importing the module first); a
    ValueError listing the registered tasks otherwise."""
    return lookup(name, TASKS, "task")


def task_spec(task: Mapping[str, Any]) -> TaskSpec:
    """The spec of the config's `task` group; `ConfigError` naming `task.name` when unknown."""
    name = task.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"config field `task.name`: required (registered tasks: {', '.join(available_tasks())})")
    try:
        return get_task(name)
    except ValueError as err:
        raise ConfigError(f"config field `task.name`: {err}") from None


def task_options(task: Mapping[str, Any]) -> Any:
    """The config's `task` group (`name` plus options) as the task's options dataclass.

    Strict: a key the task does not declare, or a value of the wrong type, is a `ConfigError`
    naming `task.<key>` and listing the valid options; the dataclass's own checks run too.
    """
    spec = task_spec(task)
    given = {k: v for k, v in task.items() if k != "name"}
    valid = [f.name for f in dataclasses.fields(spec.options)]
    for key in given:
        if key not in valid:
            raise ConfigError(
                f"config field `task.{key}`: task {spec.name!r} has no such option; valid: {', '.join(valid)}"
            )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(spec.options), OmegaConf.create(given))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"config field `task.{key}`: {str(err).splitlines()[0]}") from None
