"""The checks of a policy loss's hyper-parameters (`policy_loss.params`), run with the config
before anything loads: each is one the loss was registered with (`lit_grpo.maths.losses`), of its
default's type, and within the bounds below. The bounds are keyed by hyper-parameter name, so
every loss that takes `eps_clip` (grpo, dapo, gspo, luspo, cispo, gmpo, a user's) gets the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

from lit_grpo.maths.losses import policy_loss_defaults
from lit_grpo.maths.trust_region_losses import DPPO_DIVERGENCES

ParamCheck = Callable[[Any, Mapping[str, Any]], Optional[str]]
"""`check(value, params) -> why, or None when fine`; `params` is every hyper-parameter, defaults filled in."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _at_least_zero(value: Any, params: Mapping[str, Any]) -> Optional[str]:
    return None if value >= 0 else f"must be >= 0, got {value}"


def _positive(value: Any, params: Mapping[str, Any]) -> Optional[str]:
    return None if value > 0 else f"must be > 0, got {value}"


def _dual_clip(value: Any, params: Mapping[str, Any]) -> Optional[str]:
    return None if value > 1 else f"must be > 1 (typically 3; null: off), got {value}"


def _divergence(value: Any, params: Mapping[str, Any]) -> Optional[str]:
    ok = value in DPPO_DIVERGENCES
    return None if ok else f"must be one of {', '.join(DPPO_DIVERGENCES)}, got {value!r}"


def _dppo_threshold(divergence: str) -> ParamCheck:
    def check(value: Any, params: Mapping[str, Any]) -> Optional[str]:
        if params.get("dppo_divergence") != divergence:  # dppo reads one threshold: the other would be ignored
            return (
                f"is ignored with dppo_divergence={params.get('dppo_divergence')}: set "
                f"policy_loss.params.dppo_divergence={divergence}, or leave it unset"
            )
        return _positive(value, params)

    return check


PARAM_CHECKS: dict[str, ParamCheck] = {
    "eps_clip": _at_least_zero,
    "eps_clip_high": _at_least_zero,
    "eps_clip_c": _dual_clip,
    "sapo_tau_pos": _positive,
    "sapo_tau_neg": _positive,
    "dppo_divergence": _divergence,
    "dppo_tv_threshold": _dppo_threshold("tv"),
    "dppo_kl_threshold": _dppo_threshold("kl"),
    "dppo_ratio_cap": _positive,
    "vespo_k_pos": _at_least_zero,
    "vespo_k_neg": _at_least_zero,
    "vespo_lambda_pos": _positive,
    "vespo_lambda_neg": _positive,
    "kl_beta": _at_least_zero,
}
"""Bounds of hyper-parameters by name (a set value only; null takes the registered default)."""

RATIO_FLOOR_LOSSES = ("grpo", "dapo", "gspo", "luspo", "cispo")
"""Built-in losses whose `eps_clip` sets the ratio's lower clip, 1 - eps_clip: at eps_clip >= 1
that bound is <= 0, which no ratio (a positive number) reaches, so the clip would never act.
(gmpo clips the log-ratio at -eps_clip, where any positive value acts; a user's loss decides.)"""


def _ratio_floor(name: str, value: Any) -> Optional[str]:
    if name not in RATIO_FLOOR_LOSSES or not _number(value) or value < 1:
        return None
    return (
        f"must be < 1 for {name!r}, got {value}: its lower clip 1 - eps_clip would be {1 - value:g}, which no "
        "ratio reaches (typical: 0.2; gspo and luspo: 3e-4)"
    )


FLOAT_PARAMS = ("eps_clip_c", "dppo_tv_threshold", "dppo_kl_threshold")
"""Hyper-parameters whose default is None but whose value is a number."""


def policy_loss_param_problems(name: str, params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(hyper-parameter, why) for each of `params` the loss `name` does not take, whose type
    differs from its default's (an int is a fine float), or that is out of its bounds. A
    ValueError when `name` is not a registered loss."""
    defaults = policy_loss_defaults(name)
    filled = {**defaults, **params}
    problems = []
    for key, value in params.items():
        if key not in defaults:
            problems.append((key, f"not taken by {name!r}; valid hyper-parameters: {', '.join(sorted(defaults))}"))
            continue
        default = defaults[key]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                problems.append((key, f"must be true or false, got {value!r}"))
            continue
        if (isinstance(default, float) or key in FLOAT_PARAMS) and not _number(value):
            problems.append((key, f"must be a finite number, got {value!r}"))
        elif key in PARAM_CHECKS and (why := PARAM_CHECKS[key](value, filled)):
            problems.append((key, why))
        elif key == "eps_clip" and (why := _ratio_floor(name, value)):
            problems.append((key, why))
    return problems
