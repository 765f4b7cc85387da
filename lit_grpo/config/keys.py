"""Keys of a composed config that the schema does not have: a misspelt `+key=value` override.

Hydra's `+key=value` adds a key even where the schema has no such field, and
`OmegaConf.to_object` then drops it without a word: `+learning_rte=1e-3` would train with the
default learning rate. `unknown_keys` walks the composed config next to the schema dataclasses
and names every such key with the closest valid name. A field typed `dict` (or `Any`) is open:
its keys are checked elsewhere (`task` by the task's options) or passed on as given
(`callbacks`, `logger`, `rollout.extras`, `policy_loss.params`, `trainer.extra`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any, Union

from omegaconf import DictConfig, OmegaConf

# Keys Hydra itself may leave at the top of a composed config.
_FRAMEWORK_KEYS = ("hydra",)


def _dataclass_type(hint: Any) -> Any:
    """`hint` when it is a dataclass type, or the dataclass inside `Optional[...]`; else None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) is Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _dataclass_type(inner[0])
    return None


def _walk(node: Mapping, schema: type, prefix: str, out: list[str]) -> None:
    hints = typing.get_type_hints(schema)
    fields = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items():
        name = f"{prefix}{key}"
        if key not in fields:
            if not prefix and key in _FRAMEWORK_KEYS:
                continue
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
            where = f"`{prefix[:-1]}`" if prefix else "the config"
            fix = f"did you mean `{prefix}{close[0]}`?" if close else f"valid keys of {where}: {', '.join(fields)}"
            out.append(f"`{name}`: not a field of {where}; {fix}")
            continue
        child = _dataclass_type(hints.get(key))
        if child is not None and isinstance(value, Mapping):
            _walk(value, child, f"{name}.", out)


def unknown_keys(cfg: DictConfig | Mapping, schema: type) -> list[str]:
    """One message per key of `cfg` that the dataclass `schema` (and its nested dataclasses) does
    not declare, naming the closest valid key; [] when there is none. Interpolations are not resolved."""
    node = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    out: list[str] = []
    _walk(node, schema, "", out)
    return out


def unknown_keys_message(problems: list[str]) -> str:
    """The message of a `ConfigError` for `unknown_keys`'s problems (a `+key=value` would be ignored)."""
    why = "a `+key=value` override adds a key the run would silently ignore; fix or remove it"
    if len(problems) == 1:
        return f"config key {problems[0]} ({why})"
    return f"unknown config keys ({why}):" + "".join(f"\n  - {p}" for p in problems)
