"""Config keys that moved, and the one mechanism that keeps their old names working for one
release: `MOVED` maps each old dotted key to its new one, and three callers rename with it:

- the CLI's overrides before Hydra parses them (`rename_overrides`, from `lit_grpo.train.cli`
  and `compose_config`): `key=v`, `+key=v`, `++key=v` and `~key` alike;
- a config a Python caller built (`rename_moved_keys`, from `lit_grpo.config.parse`);
- a checkpoint's saved config, compared with the run's (`rename_saved`, silently).

Each old name used is logged once, on one line naming the new key. A YAML file that still uses
an old name fails while Hydra composes, with one line naming the new key
(`lit_grpo.config.keys.composition_error`). docs/reference/moved.md lists the table.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from lit_grpo.config.checks import ConfigError

log = logging.getLogger(__name__)

_OPTIM = ("adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "grad_clip_norm", "warmup_steps", "lr_decay")
_GUARDS = (
    "rollout_timeout_s", "rollout_max_retries", "rollout_retry_on", "rollout_failure_share",
    "rollout_failure_window", "max_rows_without_progress", "max_nonfinite_steps",
)  # fmt: skip
_LOSS_PARAMS = (
    "eps_clip", "eps_clip_high", "eps_clip_c", "dro_beta", "sapo_tau_pos", "sapo_tau_neg",
    "dppo_divergence", "dppo_tv_threshold", "dppo_kl_threshold", "dppo_ratio_cap",
)  # fmt: skip

MOVED: dict[str, str] = {
    **{name: f"optim.{name}" for name in _OPTIM},
    "micro_batch_size": "batching.micro_batch_size",
    "micro_batch_max_tokens": "batching.micro_batch_max_tokens",
    "ppo_n_minibatches": "batching.ppo_minibatches",
    "synchronous_training": "offpolicy.synchronous",
    "max_head_offpolicy_versions": "offpolicy.max_lag",
    "weight_sync_interval": "offpolicy.weight_sync_interval",
    "partial_rollouts": "offpolicy.partial_rollouts",
    "max_rollout_versions": "offpolicy.max_rollout_versions",
    "max_concurrency_rollout_sample": "rollout.max_concurrency",
    "dcp_save_interval": "checkpoint.save_interval",
    "dcp_keep_last": "checkpoint.keep_last",
    **{name: f"guards.{name}" for name in _GUARDS},
    "anchor_logp": "policy_loss.anchor_logp",
    **{f"policy_loss.{name}": f"policy_loss.params.{name}" for name in _LOSS_PARAMS},
    "policy_loss.tis_cap": "correction.cap",
    "policy_loss.tis_level": "correction.level",
    "policy_loss.advantage": "advantage",
    "policy_loss.advantage_scale": "advantage",
    "policy_loss.igpo_gamma": "advantage.params.gamma",
    "policy_loss.igpo_skip_last_ig": "advantage.params.skip_last_ig",
}
"""Old dotted key -> new dotted key. A new key naming a group (`advantage`) takes the option's name."""

MOVED_VALUES: dict[str, dict[str, str]] = {
    "policy_loss.advantage": {"group": "grpo", "igpo": "igpo"},
    "policy_loss.advantage_scale": {"std": "grpo", "none": "dr_grpo"},
}
"""Old keys whose values are renamed too: old value -> the new key's value."""

GROUP_KEYS = ("advantage",)
"""New keys that name a config group: on the command line an option (`advantage=igpo`), in a
config its `name`."""

_OVERRIDE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[A-Za-z_][\w.]*)(?P<rest>=.*)?$", re.S)


def _open_dict_key(new: str) -> bool:
    """Whether `new` is a key of a `params` dict, which need not hold it yet (set with `++`)."""
    return ".params." in new


def _unset(old: str, value: Any) -> bool:
    """Whether `old` holds "unset": null in the fields that were optional (`policy_loss.*`)."""
    return value is None and old.startswith("policy_loss.")


def _new_value(old: str, value: Any) -> Any:
    values = MOVED_VALUES.get(old)
    if values is None or not isinstance(value, str):
        return value
    return values.get(value, value)  # an unknown value reaches the new key as given, and its check names it


def moved_note(old: str, value: Any = None) -> str:
    """The one line that says where `old` went."""
    if old in MOVED_VALUES and value is not None:
        new_value = _cli_values(old, value) if isinstance(value, str) else value
        return f"{old}={value} is now {MOVED[old]}={new_value}; the old name works until the next release"
    return f"{old} is now {MOVED[old]}; the old name works until the next release"


def _cli_values(old: str, text: str) -> str:
    """An override's value(s) renamed: one value, or a sweep's comma-separated list."""
    if old not in MOVED_VALUES:
        return text
    return ",".join(str(_new_value(old, v.strip())) for v in text.split(","))


def rename_override(override: str) -> str:
    """`override` with its key's new name (and the one line saying so), or unchanged."""
    match = _OVERRIDE.match(override)
    if match is None or match["key"] not in MOVED:
        return override
    old, prefix, rest = match["key"], match["prefix"] or "", match["rest"] or ""
    new = MOVED[old]
    value = rest[1:] if rest else None
    log.warning(moved_note(old, value))
    if value is not None:
        rest = "=" + _cli_values(old, value)
    if prefix == "~":
        return f"~{new}{rest}"
    if new in GROUP_KEYS:
        return f"{new}{rest}"
    return f"{'++' if _open_dict_key(new) or prefix == '++' else ''}{new}{rest}"


def rename_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides with every old key renamed (each logged once).

    An old and a new name of one key given together (`dcp_save_interval=2
    checkpoint.save_interval=3`, or two old names of one new key) with different values is a
    `ConfigError` naming both: Hydra would keep the last silently. Equal values pass."""
    renamed = [rename_override(o) for o in overrides]
    _refuse_conflicting_names(overrides, renamed)
    return renamed


def _assignment(override: str) -> Optional[tuple[str, Any]]:
    """(key, value) that `override` sets, the key without `+`/`++` and a group's `.name`; None for
    a deletion (`~key`) or a word that is no `key=value`."""
    match = _OVERRIDE.match(override)
    if match is None or match["prefix"] == "~" or not match["rest"]:
        return None
    key, group = match["key"], match["key"].removesuffix(".name")
    return (group if group in GROUP_KEYS else key), _plain(match["rest"][1:].strip())


def _plain(text: str) -> Any:
    """An override's value as Hydra reads it, for comparison (`False` and `false`, `2` and `2.0`)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _refuse_conflicting_names(given: list[str], renamed: list[str]) -> None:
    first: dict[str, tuple[str, Any, bool]] = {}  # new key -> (override as given, value, was an old name)
    for original, override in zip(given, renamed):
        as_given, after = _assignment(original), _assignment(override)
        if as_given is None or after is None or after[0] not in MOVED.values():
            continue
        key, value = after
        old_name = as_given[0] in MOVED
        earlier, earlier_value, earlier_old = first.setdefault(key, (original, value, old_name))
        if earlier_value != value and (old_name or earlier_old):
            raise ConfigError(
                f"{earlier} and {original} set one key ({key}) to different values: give it once, as {key}"
            )


def _pop(node: Any, dotted: str) -> tuple[bool, Any]:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(node, (Mapping, DictConfig)) or part not in node:
            return False, None
        node = node[part]
    if not isinstance(node, (MutableMapping, DictConfig)) or leaf not in node:
        return False, None
    return True, node.pop(leaf)


def _set(node: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if part not in node or node[part] is None:
            node[part] = {}
        node = node[part]
    node[leaf] = value


def _has(node: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(node, (Mapping, DictConfig)) or part not in node:
            return False
        node = node[part]
    return True


def _rename(node: Any, *, announce: bool) -> None:
    for old, new in MOVED.items():
        found, value = _pop(node, old)
        if not found or _unset(old, value):
            continue
        if announce:
            log.warning(moved_note(old, value if old in MOVED_VALUES else None))
        _set(node, f"{new}.name" if new in GROUP_KEYS else new, _new_value(old, value))


def rename_moved_keys(cfg: DictConfig | Mapping) -> DictConfig | Mapping:
    """`cfg` with its old keys renamed (each logged once); `cfg` itself when it has none. The
    caller's object is never changed."""
    if not any(_has(cfg, old) for old in MOVED):
        return cfg
    if isinstance(cfg, DictConfig):
        renamed = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        assert isinstance(renamed, DictConfig)  # made from a mapping
        with open_dict(renamed):
            _rename(renamed, announce=True)
        return renamed
    renamed = copy.deepcopy(dict(cfg))
    _rename(renamed, announce=True)
    return renamed


def rename_saved(flat: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's flattened saved config (`a.b.c -> value`) under today's names, silently."""
    out = dict(flat)
    for old, new in MOVED.items():
        if old in out:
            value = out.pop(old)
            if not _unset(old, value):
                out.setdefault(f"{new}.name" if new in GROUP_KEYS else new, _new_value(old, value))
    return out


def new_name(old: str) -> Optional[str]:
    """The new dotted key of `old`, or None when it did not move."""
    return MOVED.get(old)
