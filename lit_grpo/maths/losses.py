"""Policy losses of the GRPO family: a registry of pure per-token loss functions.

Each variant (grpo, dapo, gspo, cispo, importance_sampling, dro, reinforce; and sapo, gmpo, dppo,
whose functions live in `trust_region_losses`) is a function of keyword-only `[B, T]` tensors
returning `(loss_BT, metrics)`, registered by name with its default hyper-parameters
(`register_policy_loss`; a user's module can add its own). What the variants share, and nothing
that depends on which variant it is, lives in `per_token_policy_loss`: input checks, the
training–inference mismatch correction (`lit_grpo.maths.correction`: its weights for variants
registered with `uses_tis=True`, its dropped tokens for all; a variant that declares a
`sampler_logprobs` keyword gets those logprobs themselves), the off-policy mask, the entropy
bonus and top-entropy mask, the k3 KL penalty to the reference when `kl_beta > 0`, and the
common metrics. `policy_loss` then reduces the matrix
with `aggregate_loss` in the configured normalization. The formulas and the defaults are tabled in
docs/guides/policy-losses.md. Every function taking a loss `name` also accepts `module.path:name`,
which imports `module.path` (the module that registers the loss) first, so a user's loss is usable
from the config alone.

    loss, metrics = policy_loss("dapo", logprobs=pi_BT, old_logprobs=old_BT,
                                sampler_logprobs=inf_BT, ref_logprobs=None, advantages=A_B,
                                mask=m_BT, normalization="token_mean", eps_clip_high=0.28)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo.maths.correction import correction_weights, off_policy_mask
from lit_grpo.maths.entropy import top_entropy_mask
from lit_grpo.maths.loss_terms import (
    LOSS_NORMALIZATIONS,
    aggregate_loss,
    k3,
    masked_mean,
    masked_means,
    masked_seq_mean,
    ratio,
)
from lit_grpo.maths.trust_region_losses import dppo_loss, gmpo_loss, sapo_loss
from lit_grpo.registry import lookup

__all__ = [
    "LOSS_NORMALIZATIONS",
    "POLICY_LOSSES",
    "PolicyLossSpec",
    "aggregate_loss",
    "available_policy_losses",
    "check_policy_loss_hyperparams",
    "get_policy_loss",
    "per_token_policy_loss",
    "policy_loss",
    "policy_loss_defaults",
    "register_policy_loss",
]

PolicyLossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]

_SHARED_TENSORS = ("logprobs", "old_logprobs", "advantages", "mask")
# Tensors a variant gets only if its signature names them (the sampler's logprobs, for a loss
# whose ratio is to the behaviour policy itself), and that no hyper-parameter may be called.
_OPTIONAL_TENSORS = ("sampler_logprobs",)
_TENSOR_NAMES = (*_SHARED_TENSORS, "tis_weight", *_OPTIONAL_TENSORS)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss."""

    name: str
    fn: PolicyLossFn
    """The variant: keyword-only `logprobs, old_logprobs, advantages, mask` (all `[B, T]`, the
    advantages already broadcast), `tis_weight` `[B, T]` if `uses_tis`, `sampler_logprobs`
    (`[B, T]`, detached, 0 on masked-out tokens; or None) if `takes_sampler_logprobs`, and its own
    hyper-parameters; returns the per-token loss `[B, T]` and a dict of metric tensors."""
    defaults: Mapping[str, Any]
    """Every hyper-parameter the variant takes, with its default; always includes `kl_beta`."""
    uses_tis: bool
    """Whether the loss is multiplied by the mismatch correction's weights (`tis_weight`, from
    `lit_grpo.maths.correction`); a loss without (its ratio is to the sampler already) still has
    the tokens the correction drops taken out."""
    takes_sampler_logprobs: bool = False
    """Whether the function's signature names `sampler_logprobs` (then it receives them)."""


POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_policy_loss(
    name: str, *, uses_tis: bool = True, **default_hyperparams: Any
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` with its default hyper-parameters.

    `kl_beta` defaults to 0.0 unless given here. Every other default names a keyword argument of
    the function, checked now so that a typo fails at import rather than at the first training
    step. With `uses_tis` the function takes `tis_weight`, the correction's per-token weight. A
    function whose signature names `sampler_logprobs` (explicitly, not through `**kwargs`)
    receives the sampler's logprobs, with or without `uses_tis`.
    """
    if name in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is already registered")
    if clash := sorted(set(_TENSOR_NAMES) & set(default_hyperparams)):
        raise ValueError(f"policy loss {name!r}: {', '.join(clash)} is an input tensor, not a hyper-parameter")
    defaults = {"kl_beta": 0.0, **default_hyperparams}

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        own = set(defaults) - {"kl_beta"}
        wanted = {*_SHARED_TENSORS, *own, *(["tis_weight"] if uses_tis else [])}
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            missing = sorted(wanted - set(params))
            if missing:
                raise TypeError(f"policy loss {name!r}: {fn.__name__} must accept keyword(s) {', '.join(missing)}")
        takes_sampler = "sampler_logprobs" in params and params["sampler_logprobs"].kind in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
        POLICY_LOSSES[name] = PolicyLossSpec(
            name=name, fn=fn, defaults=defaults, uses_tis=uses_tis, takes_sampler_logprobs=takes_sampler
        )
        return fn

    return decorator


def available_policy_losses() -> list[str]:
    """Names of the registered policy losses, sorted."""
    return sorted(POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLossSpec:
    """The registered loss `name` (or `module.path:name`, importing the module first); a
    ValueError listing the valid names otherwise."""
    return lookup(name, POLICY_LOSSES, "policy loss")


def policy_loss_defaults(name: str) -> dict[str, Any]:
    """Every hyper-parameter of loss `name` with its registered default (a fresh dict)."""
    return dict(get_policy_loss(name).defaults)


def check_policy_loss_hyperparams(name: str, params: Mapping[str, Any]) -> None:
    """Raise ValueError if `name` is unknown, `params` has a key the loss does not take, or
    `kl_beta` is negative.

    Cheap and tensor-free, so config validation calls it before any model loads.
    """
    defaults = get_policy_loss(name).defaults
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        moved = " (the mismatch correction is its own group: correction=tis correction.cap=... correction.level=...)"
        raise ValueError(
            f"policy loss {name!r} does not take {', '.join(unknown)}; "
            f"valid hyper-parameters: {', '.join(sorted(defaults))}"
            + (moved if {"tis_cap", "tis_level"} & set(unknown) else "")
        )
    if "kl_beta" in params and not params["kl_beta"] >= 0:
        raise ValueError(f"policy loss {name!r}: kl_beta must be >= 0, got {params['kl_beta']}")


def per_token_policy_loss(
    name: str,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    correction: str = "tis",
    correction_params: Mapping[str, Any] | None = None,
    off_policy_delta: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float | None = None,
    **hyperparams: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss of variant `name` (KL and entropy terms included), zero on masked-out tokens.

    `logprobs` carries the gradient; `old_logprobs`, `sampler_logprobs` (None: no correction, and
    None to a variant that takes them) and `ref_logprobs` (read only when kl_beta > 0) are detached
    here. Hyper-parameters not given take the registered defaults.

    What every variant gets the same way, around its own per-token term L_t:
    - the mismatch correction `correction` (`lit_grpo.maths.correction`, with `correction_params`):
      its weight is the variant's `tis_weight`, and the tokens it drops are taken out of L_t;
    - `off_policy_delta` (None: off): DeepSeek-V3.2's off-policy mask drops the negative-advantage
      tokens of sequences the policy has moved past δ from the sampler (`old` without sampler logprobs);
    - `top_entropy_quantile` q (None: off): L_t only on the tokens whose `entropy` is in the top q
      of these masked tokens;
    - then `+ kl_beta·k3(ref, π)` and `− entropy_coef·H_t` (`entropy` [B, T], differentiable for a
      bonus), on every masked token.
    A dropped token stays in the normalizer's count: the loss is that of the others, at the same scale.
    Metrics are detached scalars: `clip_frac`, `ratio_mean`, `ppo_kl` (k3 of π against old),
    `ref_kl` when kl_beta > 0, `correction/weight_mean`, `correction/capped_frac`,
    `correction/masked_frac` (loss variants with `uses_tis`: the first; all: the others),
    `correction/off_policy_frac`, `entropy/kept_frac` with a quantile, plus the variant's own.
    Shapes: [B, T] tensors, advantages [B] or [B, T]; returns [B, T].
    """
    spec = get_policy_loss(name)
    check_policy_loss_hyperparams(name, hyperparams)
    params = {**spec.defaults, **hyperparams}
    kl_beta = params.pop("kl_beta")
    _check_shapes(logprobs, old_logprobs, sampler_logprobs, ref_logprobs, advantages, mask)
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError(f"policy loss {name!r} has kl_beta={kl_beta} > 0 but no ref_logprobs were given")
    if (entropy_coef != 0 or top_entropy_quantile is not None) and entropy is None:
        raise ValueError("an entropy bonus or top_entropy_quantile needs the per-token `entropy`")

    mask_BT = mask.to(logprobs.dtype)
    keep_BT = mask_BT > 0
    advantages_BT = advantages.detach().to(logprobs.dtype)
    if advantages_BT.ndim == 1:
        advantages_BT = advantages_BT[:, None].expand_as(logprobs)
    # Padding may hold anything (-inf, nan): zero every input on masked-out tokens before any
    # arithmetic, because a `where` on the loss alone cannot stop 0 * nan in the backward pass.
    logprobs = torch.where(keep_BT, logprobs, 0.0)
    old_BT = torch.where(keep_BT, old_logprobs.detach(), 0.0)
    sampler_BT = None if sampler_logprobs is None else torch.where(keep_BT, sampler_logprobs.detach(), 0.0)
    advantages_BT = torch.where(keep_BT, advantages_BT, 0.0)
    pi_BT = logprobs.detach()
    w_BT, dropped_BT, capped_BT = correction_weights(
        correction, old_logprobs=old_BT, sampler_logprobs=sampler_BT, mask=mask_BT, **(correction_params or {})
    )
    per_token = {
        "ratio_mean": ratio(pi_BT, old_BT),
        "ppo_kl": k3(old_BT, pi_BT),
        "correction/capped_frac": capped_BT,
        "correction/masked_frac": dropped_BT,
    }
    if spec.uses_tis:
        per_token["correction/weight_mean"] = w_BT
    if off_policy_delta is not None:
        behaviour_BT = old_BT if sampler_BT is None else sampler_BT
        far_BT = off_policy_mask(
            logprobs=pi_BT, behaviour_logprobs=behaviour_BT, advantages=advantages_BT, mask=mask_BT,
            delta=off_policy_delta,
        )  # fmt: skip
        per_token["correction/off_policy_frac"] = far_BT
        dropped_BT = dropped_BT | far_BT
    if top_entropy_quantile is not None:
        low_entropy_BT = ~top_entropy_mask(entropy.detach(), mask_BT, top_entropy_quantile) & keep_BT
        per_token["entropy/kept_frac"] = ~low_entropy_BT
        dropped_BT = dropped_BT | low_entropy_BT
    tensors = {"logprobs": logprobs, "old_logprobs": old_BT, "advantages": advantages_BT, "mask": mask_BT}
    if spec.uses_tis:
        tensors["tis_weight"] = torch.where(dropped_BT, 0.0, w_BT)
    if spec.takes_sampler_logprobs:
        tensors["sampler_logprobs"] = sampler_BT

    loss_BT, variant_metrics = spec.fn(**tensors, **params)
    loss_BT = torch.where(dropped_BT, 0.0, loss_BT)  # a dropped token's whole policy term, penalties included
    metrics = {
        "clip_frac": torch.zeros((), dtype=logprobs.dtype, device=logprobs.device),
        **masked_means(per_token, mask_BT),
    }
    metrics.update(variant_metrics)
    if kl_beta > 0:
        kl_BT = k3(torch.where(keep_BT, ref_logprobs.detach(), 0.0), logprobs)
        loss_BT = loss_BT + kl_beta * kl_BT
        metrics["ref_kl"] = masked_mean(kl_BT.detach(), mask_BT)
    if entropy_coef != 0:
        loss_BT = loss_BT - entropy_coef * torch.where(keep_BT, entropy, 0.0)
    loss_BT = torch.where(keep_BT, loss_BT, 0.0)  # a user's variant may put loss on padding
    return loss_BT, {key: value.detach() for key, value in metrics.items()}


def policy_loss(
    name: str,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalization: str = "token_mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | float | torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss of variant `name`, reduced by `aggregate_loss(…, normalization)`.

    See `per_token_policy_loss` for the tensors, the shared controls (correction, off-policy mask,
    entropy), the hyper-parameters and metrics, and `aggregate_loss` for
    `num_tokens`/`num_sequences`. Shape: [B, T] inputs -> [].
    """
    if normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(f"unknown loss normalization {normalization!r}; valid: {', '.join(LOSS_NORMALIZATIONS)}")
    loss_BT, metrics = per_token_policy_loss(
        name, logprobs=logprobs, old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs,
        ref_logprobs=ref_logprobs, advantages=advantages, mask=mask, **kwargs,
    )  # fmt: skip
    loss = aggregate_loss(loss_BT, mask, normalization, num_tokens=num_tokens, num_sequences=num_sequences)
    return loss, metrics


def _check_shapes(logprobs, old_logprobs, sampler_logprobs, ref_logprobs, advantages, mask) -> None:
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    named = {"old_logprobs": old_logprobs, "sampler_logprobs": sampler_logprobs, "ref_logprobs": ref_logprobs}
    for key, tensor in {**named, "mask": mask}.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{key} must have the shape of logprobs {shape}, got {tuple(tensor.shape)}")
    if tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B, T] for logprobs {shape}, got {tuple(advantages.shape)}")


def _clipped_surrogate(ratio_BT, advantages_BT, eps_low, eps_high) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate max(-r·A, -clip(r)·A) and where its clipped branch won."""
    unclipped_BT = -ratio_BT * advantages_BT
    clipped_BT = -ratio_BT.clamp(1 - eps_low, 1 + eps_high) * advantages_BT
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT


def _frac(flags_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags_BT.to(mask_BT.dtype), mask_BT)


@register_policy_loss("grpo", kl_beta=0.001, eps_clip=0.2, eps_clip_high=0.2)
def grpo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """GRPO (DeepSeekMath): PPO's clipped ratio, max(-r·A, -clip(r)·A)·w. Shape: [B, T]."""
    loss_BT, clipped_BT = _clipped_surrogate(ratio(logprobs, old_logprobs), advantages, eps_clip, eps_clip_high)
    return loss_BT * tis_weight, {"clip_frac": _frac(clipped_BT, mask)}


@register_policy_loss("dapo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None)
def dapo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high, eps_clip_c):
    """DAPO: clip-higher (ε_high > ε_low) and, when `eps_clip_c` is set, the dual clip
    min(c·(-A), ·) on negative advantages, bounding the loss of a token whose ratio exploded.
    Extra metric `dual_clip_frac`. Shape: [B, T]."""
    loss_BT, clipped_BT = _clipped_surrogate(ratio(logprobs, old_logprobs), advantages, eps_clip, eps_clip_high)
    dual_BT = torch.zeros_like(clipped_BT)
    if eps_clip_c is not None:
        if not eps_clip_c > 1:
            raise ValueError(f"dapo: eps_clip_c must be > 1 (typically 3), got {eps_clip_c}")
        bound_BT = -eps_clip_c * advantages
        dual_BT = (advantages < 0) & (bound_BT < loss_BT)
        loss_BT = torch.where(dual_BT, bound_BT, loss_BT)
    return loss_BT * tis_weight, {"clip_frac": _frac(clipped_BT, mask), "dual_clip_frac": _frac(dual_BT, mask)}


@register_policy_loss("gspo", eps_clip=3e-4, eps_clip_high=4e-4)
def gspo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """GSPO: one ratio per sequence, R = exp(s) with s the masked mean of π - old, clipped like
    PPO (hence the tiny ε). Written per token as exp(π - sg(π) + sg(s)) so each token's gradient
    is R·∇π_t (GSPO-token) and per-token advantages still work; the exponent is capped at 10.
    `ratio_mean` is the mean of R. Shape: [B, T]."""
    s_B1 = masked_seq_mean((logprobs - old_logprobs).detach(), mask)[:, None]
    seq_ratio_BT = torch.exp((logprobs - logprobs.detach() + s_B1).clamp(max=10.0))
    loss_BT, clipped_BT = _clipped_surrogate(seq_ratio_BT, advantages, eps_clip, eps_clip_high)
    metrics = {"clip_frac": _frac(clipped_BT, mask), "ratio_mean": masked_mean(seq_ratio_BT.detach(), mask)}
    return loss_BT * tis_weight, metrics


@register_policy_loss("cispo", eps_clip=0.2, eps_clip_high=0.28)
def cispo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """CISPO (MiniMax-M1): REINFORCE weighted by the clipped, detached ratio, -sg(clip(r))·π·A·w,
    so clipped tokens still get a gradient. `clip_frac`: ratio outside the band. Shape: [B, T]."""
    ratio_BT = ratio(logprobs, old_logprobs).detach()
    weight_BT = ratio_BT.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss_BT = -weight_BT * logprobs * advantages * tis_weight
    return loss_BT, {"clip_frac": _frac(weight_BT != ratio_BT, mask)}


@register_policy_loss("importance_sampling")
def importance_sampling_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight):
    """Unclipped importance-sampled policy gradient, -r·A·w. Shape: [B, T]."""
    return -ratio(logprobs, old_logprobs) * advantages * tis_weight, {}


@register_policy_loss("dro", dro_beta=0.05)
def dro_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, dro_beta):
    """DRO: REINFORCE with a quadratic proximal penalty instead of a ratio clip,
    -(π·A·w - ½·β·(π - old)²). Shape: [B, T]."""
    return -(logprobs * advantages * tis_weight - 0.5 * dro_beta * (logprobs - old_logprobs) ** 2), {}


@register_policy_loss("reinforce", uses_tis=False)
def reinforce_loss(*, logprobs, old_logprobs, sampler_logprobs, advantages, mask):
    """REINFORCE as the cookbook writes it: -exp(clamp(π - inf, -20, 20))·A, the ratio to the
    sampler's logprobs (the behaviour policy that generated the tokens), with no clip and no TIS;
    `old` plays no part. With no sampler logprobs, inf = sg(π): the value is -A per token and the
    gradient -A·∇π, plain -π·A's. `ratio_mean` is the mean of this ratio. Shape: [B, T]."""
    behaviour_BT = logprobs.detach() if sampler_logprobs is None else sampler_logprobs
    ratio_BT = ratio(logprobs, behaviour_BT)
    return -ratio_BT * advantages, {"ratio_mean": masked_mean(ratio_BT.detach(), mask)}


# The newer trust regions live in their own module (which cannot import this one); their defaults are here.
register_policy_loss("sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)(sapo_loss)
register_policy_loss("gmpo", eps_clip=0.4, eps_clip_high=0.4)(gmpo_loss)
register_policy_loss("dppo", dppo_divergence="tv", dppo_tv_threshold=None, dppo_kl_threshold=None, dppo_ratio_cap=20.0)(
    dppo_loss
)
