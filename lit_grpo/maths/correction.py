"""Training–inference mismatch correction: the weight each token's loss gets because the sampler
that generated it is not exactly the trainer (another engine, another precision, stale weights).

Every mode is a pure function of the per-token log-ratio `d = old − sampler` (the trainer's
logprob before this batch's update minus the sampler's, detached) and the loss mask, returning
`(weight_BT, masked_BT, capped_BT)`: the detached weight that multiplies each token's policy loss,
the tokens it drops (weight 0), and the tokens whose weight it truncated. A sequence-level mode
uses the sequence's masked mean of `d` (the log of the geometric mean ratio), broadcast.
`geo_mask` alone bounds the reciprocal, sampler/old, as verl's `seq_mean_k1` does.

| mode | weight | source |
|---|---|---|
| `none` | 1 | |
| `tis` | min(r, cap) | truncated IS (Yao et al. 2025; the cookbook's TISConfig, verl `rollout_is`) |
| `mask` | r if r <= cap, else 0 | TRL `vllm_importance_sampling_mode=token_mask/sequence_mask` |
| `icepop` | r if low <= r <= high, else 0 | IcePop (Ring-1T, 2025); verl `rollout_is_threshold="low_high"` |
| `geo_mask` | 1 if low <= exp(−mean d) <= high, else 0 (per sequence) | verl `rollout_rs=seq_mean_k1` |
| `kl_reject` | 1 if the KL estimate <= threshold, else 0 | verl's k1/k2/k3 rejection |

with r = exp(clamp(d, −20, 20)). `off_policy_mask` is DeepSeek-V3.2's separate switch: a token
with A < 0 in a sequence the current policy has moved away from by more than δ is dropped.
The registry is open: `register_correction("mine", cap=2.0)` on a function of the same form.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo.maths.loss_terms import masked_seq_mean
from lit_grpo.registry import lookup

CORRECTION_LEVELS = ("token", "sequence")
"""`level`: each token its own ratio, or its sequence's geometric-mean ratio."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""`kl_reject`'s per-token estimates of KL(sampler ‖ trainer) from d = old − sampler: k1 = |d| at
token level (−d averaged, then its size, at sequence level), k2 = d²/2, k3 = e^d − 1 − d."""

# exp() of a log-ratio beyond ±20 only overflows or underflows (the loss's own ratio clamp).
_LOG_RATIO_CLAMP = 20.0

CorrectionFn = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class CorrectionSpec:
    """A registered correction mode: `fn(log_ratio_BT, mask_BT, **params) -> (weight, masked, capped)`."""

    name: str
    fn: CorrectionFn
    defaults: Mapping[str, Any]


CORRECTIONS: dict[str, CorrectionSpec] = {}


def register_correction(name: str, **defaults: Any) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator registering a correction mode with its default parameters (each must be a
    keyword of the function, checked now)."""
    if name in CORRECTIONS:
        raise ValueError(f"correction {name!r} is already registered")

    def decorator(fn: CorrectionFn) -> CorrectionFn:
        missing = sorted(set(defaults) - set(inspect.signature(fn).parameters))
        if missing:
            raise TypeError(f"correction {name!r}: {fn.__name__} must accept keyword(s) {', '.join(missing)}")
        CORRECTIONS[name] = CorrectionSpec(name=name, fn=fn, defaults=dict(defaults))
        return fn

    return decorator


def get_correction(name: str) -> CorrectionSpec:
    """The registered mode `name` (or `module.path:name`); a ValueError listing the valid ones otherwise."""
    return lookup(name, CORRECTIONS, "correction")


def available_corrections() -> list[str]:
    return sorted(CORRECTIONS)


def correction_param_problems(name: str, params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`(key, why)` for each parameter of `params` that mode `name` does not take or cannot use.
    Cheap and tensor-free: config validation calls it before any model loads."""
    defaults = get_correction(name).defaults
    problems = [(key, f"mode {name!r} does not take it") for key in sorted(set(params) - set(defaults))]
    merged = {**defaults, **{k: v for k, v in params.items() if k in defaults}}
    if "level" in merged and merged["level"] not in CORRECTION_LEVELS:
        problems.append(("level", f"must be one of {', '.join(CORRECTION_LEVELS)}, got {merged['level']!r}"))
    if "estimator" in merged and merged["estimator"] not in KL_ESTIMATORS:
        problems.append(("estimator", f"must be one of {', '.join(KL_ESTIMATORS)}, got {merged['estimator']!r}"))
    for key in ("cap", "low", "high", "threshold"):
        if key in merged and not (isinstance(merged[key], (int, float)) and 0 < merged[key] < float("inf")):
            problems.append((key, f"must be a positive finite number, got {merged[key]!r}"))
    if {"low", "high"} <= set(merged) and not problems and not merged["low"] <= merged["high"]:
        problems.append(("low", f"must be <= high ({merged['high']}), got {merged['low']}"))
    return problems


def level_log_ratio(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, level: str) -> torch.Tensor:
    """Each token's own log-ratio (`token`), or its sequence's masked mean, broadcast (`sequence`).

    Shape: [B, T], [B, T] -> [B, T].
    """
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown correction level {level!r}; valid: {', '.join(CORRECTION_LEVELS)}")
    if level == "token":
        return log_ratio_BT
    return masked_seq_mean(log_ratio_BT, mask_BT)[:, None].expand_as(log_ratio_BT)


def _ratio(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio_BT.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _nothing(like_BT: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like_BT, dtype=torch.bool)


@register_correction("none")
def no_correction(log_ratio_BT, mask_BT):
    """Weight 1 everywhere: the sampler is taken to be the trainer."""
    return torch.ones_like(log_ratio_BT), _nothing(log_ratio_BT), _nothing(log_ratio_BT)


@register_correction("tis", level="token", cap=5.0)
def truncated_importance_sampling(log_ratio_BT, mask_BT, *, level, cap):
    """Truncated importance sampling: w = min(r, cap); `capped` where r > cap. Nothing is dropped."""
    r_BT = _ratio(level_log_ratio(log_ratio_BT, mask_BT, level))
    return r_BT.clamp(max=cap), _nothing(r_BT), r_BT > cap


@register_correction("mask", level="sequence", cap=3.0)
def masked_importance_sampling(log_ratio_BT, mask_BT, *, level, cap):
    """Importance sampling with rejection: w = r where r <= cap, else 0 (dropped). The default is
    TRL's (`sequence_mask`, cap 3), with the sequence's ratio its geometric mean here."""
    r_BT = _ratio(level_log_ratio(log_ratio_BT, mask_BT, level))
    masked_BT = r_BT > cap
    return torch.where(masked_BT, 0.0, r_BT), masked_BT, _nothing(r_BT)


@register_correction("icepop", low=0.5, high=2.0)
def icepop(log_ratio_BT, mask_BT, *, low, high):
    """IcePop (Ring-1T): per token, w = r inside the band [low, high] (edges included), 0 outside."""
    r_BT = _ratio(log_ratio_BT)
    masked_BT = (r_BT < low) | (r_BT > high)
    return torch.where(masked_BT, 0.0, r_BT), masked_BT, _nothing(r_BT)


@register_correction("geo_mask", low=0.999, high=1.001)
def geometric_mean_mask(log_ratio_BT, mask_BT, *, low, high):
    """Sequence rejection on the geometric mean of the sampler-to-trainer ratio, exp(mean(−d)) =
    exp(mean(sampler − old)): a sequence outside [low, high] (edges kept) is dropped, a kept one
    weighs 1. This is verl's `rollout_rs=seq_mean_k1` orientation (its k1 is −d, compared in log
    space with each token's d clamped at ±20 first; its Geo-RS band 0.999_1.001 is the default),
    the reciprocal of the old/sampler ratio the other modes bound: with an asymmetric band the two
    keep different sequences ([0.5, 1] keeps a mean old/sampler of 2, not one of 0.5)."""
    k1_BT = -level_log_ratio(log_ratio_BT.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), mask_BT, "sequence")
    masked_BT = (k1_BT < math.log(low)) | (k1_BT > math.log(high))
    return torch.where(masked_BT, 0.0, 1.0).to(log_ratio_BT.dtype), masked_BT, _nothing(k1_BT)


def kl_estimate(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, estimator: str, level: str) -> torch.Tensor:
    """The `KL_ESTIMATORS` estimate of KL(sampler ‖ trainer) per token, or per sequence (its masked
    mean, broadcast; k1's size is taken after the mean). Shape: [B, T], [B, T] -> [B, T], >= 0."""
    d_BT = log_ratio_BT
    per_token = {"k1": -d_BT, "k2": 0.5 * d_BT**2, "k3": torch.expm1(d_BT.clamp(max=_LOG_RATIO_CLAMP)) - d_BT}
    if estimator not in per_token:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return level_log_ratio(per_token[estimator], mask_BT, level).abs()


@register_correction("kl_reject", level="sequence", estimator="k3", threshold=0.01)
def kl_rejection(log_ratio_BT, mask_BT, *, level, estimator, threshold):
    """Rejection by a KL estimate: a token (or sequence) whose estimate exceeds `threshold` is dropped."""
    masked_BT = kl_estimate(log_ratio_BT, mask_BT, estimator, level) > threshold
    return torch.where(masked_BT, 0.0, 1.0).to(log_ratio_BT.dtype), masked_BT, _nothing(log_ratio_BT)


def correction_weights(
    name: str,
    *,
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    **params: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mode `name`'s `(weight, masked, capped)` for these tokens (see the module docstring).

    Masked-out tokens get weight 1 and are never counted as masked or capped; with no sampler
    logprobs every weight is 1 (the sampler is assumed exact). Parameters not given take the
    registered defaults. Shapes: [B, T] each -> three [B, T] (float, bool, bool), detached.
    """
    spec = get_correction(name)
    keep_BT = mask > 0
    if sampler_logprobs is None:
        return torch.ones_like(old_logprobs), _nothing(old_logprobs), _nothing(old_logprobs)
    # `where`, not a product: garbage at padded positions must not leak in.
    log_ratio_BT = torch.where(keep_BT, (old_logprobs - sampler_logprobs).detach(), 0.0)
    weight_BT, masked_BT, capped_BT = spec.fn(log_ratio_BT, mask.to(log_ratio_BT.dtype), **{**spec.defaults, **params})
    weight_BT = torch.where(keep_BT, weight_BT.to(old_logprobs.dtype), 1.0)
    return weight_BT, masked_BT & keep_BT, capped_BT & keep_BT


def off_policy_mask(
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking: the tokens with A < 0 of a sequence whose mean
    log-ratio of the behaviour policy to the current one, (1/|o|)·Σ_t (behaviour_t − π_t), exceeds
    `delta`. Those are negative updates on samples the policy has already moved away from, the
    ones most likely to destabilize training. With per-sequence advantages this drops whole
    sequences; with per-token advantages (IGPO) the negative tokens of such a sequence.

    Shapes: logprobs, behaviour [B, T] (detached), advantages [B, T], mask [B, T] -> bool [B, T].
    """
    keep_BT = mask > 0
    d_BT = torch.where(keep_BT, behaviour_logprobs.detach() - logprobs.detach(), 0.0)
    far_B1 = (masked_seq_mean(d_BT, mask.to(d_BT.dtype)) > delta)[:, None]
    return far_B1 & (advantages < 0) & keep_BT
