"""Keys of a config that the schema does not have: a misspelt `+key=value` override, and a key
Hydra refuses while composing (a misspelt `key=value`, or an old name in a YAML file).

Hydra's `+key=value` adds a key even where the schema has no such field, and
`OmegaConf.to_object` then drops it without a word: `+learning_rte=1e-3` would train with the
default learning rate. `unknown_keys` walks the composed config next to the schema dataclasses
and names every such key with the closest valid name. A field typed `dict` (or `Any`) is open:
its keys are checked elsewhere (`task` by the task's options) or passed on as given
(`callbacks`, `logger`, `rollout.extras`, `policy_loss.params`, `trainer.extra`).

Hydra words an unknown key as a block that suggests `+key=value` (which would be silently
ignored); `composition_error` makes it one line naming the key meant (`closest_key`: the closest
last part first, so `trainer.max_step` is `max_steps`) or the new name of one that moved.
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
    assert isinstance(node, Mapping)  # a DictConfig's container is a dict
    out: list[str] = []
    _walk(node, schema, "", out)
    return out


def unknown_keys_message(problems: list[str]) -> str:
    """The message of a `ConfigError` for `unknown_keys`'s problems (a `+key=value` would be ignored)."""
    why = "a `+key=value` override adds a key the run would silently ignore; fix or remove it"
    if len(problems) == 1:
        return f"config key {problems[0]} ({why})"
    return f"unknown config keys ({why}):" + "".join(f"\n  - {p}" for p in problems)


def known_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclass `schema` and its nested dataclasses (groups and fields)."""
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        keys.append(prefix + f.name)
        child = _dataclass_type(hints.get(f.name))
        if child is not None:
            keys += known_keys(child, f"{prefix}{f.name}.")
    return keys


def closest_key(key: str, known: list[str]) -> str | None:
    """The known dotted key `key` most likely meant: the closest last part first (`trainer.max_step`
    is `max_steps`, not `trainer.max_epochs`), then the closest whole path; None when nothing is close."""

    def score(candidate: str) -> tuple[float, float]:
        leaf = difflib.SequenceMatcher(None, key.rsplit(".", 1)[-1], candidate.rsplit(".", 1)[-1]).ratio()
        return leaf, difflib.SequenceMatcher(None, key, candidate).ratio()

    best = max(known, key=score, default=None)
    return best if best is not None and score(best)[0] >= 0.6 else None


def _open_dict_parent(key: str, schema: type) -> str | None:
    """The `dict`-typed field (`task`, `policy_loss.params`, ...) that `key` lies under, or None."""
    parts, hints_of = key.split("."), schema
    for i, part in enumerate(parts[:-1]):
        hints = typing.get_type_hints(hints_of)
        if part not in hints:
            return None
        child = _dataclass_type(hints[part])
        if child is None:
            return ".".join(parts[: i + 1])
        hints_of = child
    return None


def misspelt_key_message(key: str, schema: type, moved: Mapping[str, str]) -> str:
    """One line for a key the schema does not have: where an old name went, the key meant, or how
    to add a key to an open dict (`+task.num_rows=...`)."""
    if key in moved:
        return (
            f"config key `{key}` is now `{moved[key]}`; rename it (old names work on the command line and "
            "in Python for one release, not in a YAML file)"
        )
    if (parent := _open_dict_parent(key, schema)) is not None:
        return (
            f"config key `{key}`: `{parent}` has no `{key[len(parent) + 1 :]}` here; "
            f"add a key there with `+{key}=...` (its reader checks the name)"
        )
    close = closest_key(key, [*known_keys(schema), *moved])
    if close is None:
        return f"config key `{key}` does not exist (docs/reference/config.md lists every key)"
    return f"config key `{key}` does not exist; did you mean `{moved.get(close, close)}`?"


def composition_error(err: BaseException, schema: type, moved: Mapping[str, str]) -> str | None:
    """One line for Hydra's composition error `err` when it is an unknown key (a misspelt one, or
    an old name in a YAML file); None for any other (Hydra's own message says it well)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
            key = str(cause.full_key)
            return None if key.split(".")[0] in _FRAMEWORK_KEYS else misspelt_key_message(key, schema, moved)
        cause = cause.__cause__ or cause.__context__
    return None
