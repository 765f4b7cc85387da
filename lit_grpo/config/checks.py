"""What every config group's validation shares: the error a user sees, the checks that name the
field, and the bounds and field metadata several groups use."""

from __future__ import annotations

import math
from typing import Any, Optional

from lit_grpo.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value that cannot work; the message names the field."""


def require(ok: bool, field_name: str, message: str) -> None:
    """Raise `ConfigError` naming `field_name` (its dotted path, e.g. `task.num_rows`) unless `ok`."""
    if not ok:
        raise ConfigError(f"config field `{field_name}`: {message}")


def require_finite(value: Any, field_name: str) -> None:
    """Raise `ConfigError` unless `value` is a finite number (NaN and ±inf pass the usual `> 0` checks badly)."""
    require(
        isinstance(value, (int, float)) and math.isfinite(value), field_name, f"must be a finite number, got {value!r}"
    )


MAX_TEMPERATURE = 100.0
"""Above this the sampling distribution is uniform to any precision: a typo, not a setting."""
MAX_LEARNING_RATE = 1.0


DEFINES_STATE = {"defines_state": True}
"""Field metadata: the field defines what a checkpoint's state means, so resuming with another
value is refused (`lit_grpo.run.checkpoint.check_resumable`). On a sub-config: all of it."""


def exception_class(name: str) -> Optional[type[BaseException]]:
    """The exception class `name` names (a builtin, or `module.Class`), or None."""
    import builtins
    import importlib

    found = getattr(builtins, name, None)
    if found is None and "." in name:
        module, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            found = None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None
