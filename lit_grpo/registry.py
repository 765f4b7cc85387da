"""Names in the config that point into a registry: `name`, or `module.path:name` for a user's entry.

A user registers a policy loss or a task in a module of their own (`@register_policy_loss("mine")`,
`register_task("mine", ...)`). Naming it `my_pkg.my_losses:mine` in the config imports
`my_pkg.my_losses` first (the working directory is importable, as for `rollout.factory`), and that
import is what registers `mine`. So a user's entry is usable from YAML or the command line alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from lit_grpo.errors import UserError, import_user_module

T = TypeVar("T")


def lookup(name: str, registry: Mapping[str, T], what: str) -> T:
    """The entry `name` of `registry`, importing `module` first when `name` is `module:entry`.

    ValueError (naming `what`, e.g. "policy loss", and listing the registered names) when the
    module cannot be imported or registers no such entry.
    """
    module_name, sep, entry = name.rpartition(":")
    if sep:
        if not module_name or not entry:
            raise ValueError(f"{what} {name!r}: expected 'name' or 'module.path:name'")
        try:
            import_user_module(module_name, f"{what} {name!r}: cannot import module {module_name!r}")
        except UserError as err:
            raise ValueError(str(err)) from err.__cause__
    else:
        entry = name
    try:
        return registry[entry]
    except KeyError:
        where = f" (module {module_name!r} registers none under that name)" if sep else ""
        raise ValueError(f"unknown {what} {entry!r}{where}; valid: {', '.join(sorted(registry))}") from None
