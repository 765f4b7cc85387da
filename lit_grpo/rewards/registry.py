"""The reward registry: `reward(completion_text, row) -> float | None` functions, by name.

    @register_reward("mine")
    def mine(completion_text: str, row: dict) -> float | None: ...

A reward reads the row as it was stored (`lit_grpo.tasks.rows`); None means "not applicable to this
row" (a weighted sum skips it; a sample whose every component is None is dropped). `reward.fn`
names a registered reward, or `module:function` in a module of your own (imported from the
working directory); a module that registers rewards can also be named `module:registered_name`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Optional

from lit_grpo.config import ConfigError
from lit_grpo.config.groups import REWARD_MODEL
from lit_grpo.errors import UserError, import_user_object

RewardFn = Callable[[str, dict], Optional[float]]
REWARDS: dict[str, RewardFn] = {}


class RewardRowError(UserError, LookupError):
    """A row a reward cannot score (no reference answer, or one it cannot read). A LookupError:
    raised in a rollout it stops training at once, with this message."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn(completion_text, row) -> float | None` as reward `name`."""

    def register(fn: RewardFn) -> RewardFn:
        if name == REWARD_MODEL:
            raise ValueError(
                f"reward name {REWARD_MODEL!r} is the reward model's component (reward.model): choose another"
            )
        known = REWARDS.get(name)
        same = known is not None and (known.__module__, known.__qualname__) == (fn.__module__, fn.__qualname__)
        if known is not None and not same:  # re-importing the module that defines it is fine
            raise ValueError(f"reward {name!r} is already registered ({known.__module__}.{known.__qualname__})")
        REWARDS[name] = fn
        return fn

    return register


INLINE_ATTRIBUTE = "lit_grpo_inline"


def inline_reward(fn: RewardFn) -> RewardFn:
    """Mark a plain reward as cheap and pure (a string match, a parse): it is called on the rollouts'
    event loop itself, with no thread and no deadline (`lit_grpo.rewards.scoring`). Every built-in
    is; leave anything that may take long (a subprocess, a network call, a big regex) unmarked."""
    setattr(fn, INLINE_ATTRIBUTE, True)
    return fn


def available_rewards() -> list[str]:
    """Names of the registered rewards, sorted (the built-ins are registered by the package's
    `__init__`, which Python runs before this module)."""
    return sorted(REWARDS)


def get_reward(spec: str, field: str = "reward.fn") -> RewardFn:
    """The reward `spec` names: a registered name, or `module:function` (imported from the working
    directory). `ConfigError` naming `field` when it is unknown, cannot be imported, or cannot
    be called as `reward(completion_text, row)`."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"config field `{field}`: must be a reward name or 'module:function', got {spec!r}")
    names = available_rewards()
    if ":" not in spec:
        if spec not in REWARDS:
            raise ConfigError(
                f"config field `{field}`: unknown reward {spec!r}; registered: {', '.join(names)}, "
                f"{REWARD_MODEL} (the reward model of reward.model), or 'module:function' for one of your own"
            )
        return REWARDS[spec]
    module_name, _, attr = spec.rpartition(":")
    try:
        fn = import_user_object(spec, field)
    except UserError as err:
        registered = REWARDS.get(attr)  # `module:name` where the module registered `name`
        if module_name in sys.modules and registered is not None and registered.__module__ == module_name:
            return registered
        raise ConfigError(str(err)) from err.__cause__
    _check_callable(fn, spec, field)
    return fn


def _check_callable(fn: object, spec: str, field: str) -> None:
    if not callable(fn):
        raise ConfigError(f"config field `{field}`: {spec!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError as err:
        raise ConfigError(f"config field `{field}`: {spec!r} must take (completion_text, row): {err}") from None
    except ValueError:  # no signature to read (a builtin): the first call will tell
        pass


def reward_name(spec: str) -> str:
    """A component's short name, for its metric `reward/<name>`: the registered name, or the
    function's own name for `module:function`; `reward_model` for the reward model."""
    if spec == REWARD_MODEL:  # built from reward.model (`lit_grpo.rewards.reward_model`), not registered
        return spec
    fn = get_reward(spec)  # also checks that it exists
    if ":" not in spec:
        return spec
    attr = spec.rpartition(":")[2]
    name = getattr(fn, "__name__", "")
    return attr if REWARDS.get(attr) is fn or not name.isidentifier() else name  # a lambda: the attribute's name


def reference_field(row: dict, fields: tuple[str, ...], reward: str) -> str:
    """The first of `fields` that `row` has (not None); `RewardRowError` naming the row's fields otherwise."""
    for name in fields:
        if row.get(name) is not None:
            return name
    have = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
    raise RewardRowError(
        f"reward {reward!r}: the row has no reference answer (field {' or '.join(map(repr, fields))}); "
        f"its fields: {have}. "
        "Give the rows that field, or choose a reward that reads the fields they have (reward.fn)"
    )
