"""Policy losses of the GRPO family: the shared per-token loss around each registered variant, and
its reduction to the scalar that is backpropagated.

The variants (grpo, dapo, gspo, luspo, cispo, importance_sampling, dro, reinforce in `ppo_losses`;
sapo, gmpo, dppo, vespo in `trust_region_losses`) are pure functions of keyword-only `[B, T]`
tensors returning `(loss_BT, metrics)`, each registered by name with its default hyper-parameters in the module that
defines it (`lit_grpo.maths.loss_registry`; a user's module can add its own). Importing this module
registers the built-ins. What the variants share, and nothing that depends on which variant it
is, lives in `per_token_policy_loss`: input checks, the training–inference mismatch correction
(`lit_grpo.maths.correction`: its weights for variants registered with `uses_tis=True`, its
dropped tokens for all; a variant that declares a `sampler_logprobs` keyword gets those logprobs
themselves), the off-policy mask, the entropy bonus and top-entropy mask, the k3 KL penalty to the
reference when `kl_beta > 0`, and the common metrics. `policy_loss` then reduces the matrix with
`aggregate_loss` in the configured normalization. The formulas and the defaults are tabled in
docs/guides/policy-losses.md.

    loss, metrics = policy_loss("dapo", logprobs=pi_BT, old_logprobs=old_BT,
                                sampler_logprobs=inf_BT, ref_logprobs=None, advantages=A_B,
                                mask=m_BT, normalization="token_mean", eps_clip_high=0.28)

A training loop builds a `LossSettings` once (the variant, its hyper-parameters, the correction,
the entropy controls, the normalization) and calls `policy_loss_with(settings, <tensors>)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Imported for their registrations: each family registers its variants where it defines them.
from lit_grpo.maths import ppo_losses, trust_region_losses  # noqa: F401
from lit_grpo.maths.correction import correction_weights, off_policy_mask
from lit_grpo.maths.entropy import top_entropy_mask
from lit_grpo.maths.loss_registry import (
    POLICY_LOSSES,
    PolicyLossSpec,
    available_policy_losses,
    check_policy_loss_hyperparams,
    get_policy_loss,
    policy_loss_defaults,
    register_policy_loss,
)
from lit_grpo.maths.loss_terms import LOSS_NORMALIZATIONS, aggregate_loss, k3, masked_mean, masked_means, ratio

__all__ = [
    "LOSS_NORMALIZATIONS",
    "POLICY_LOSSES",
    "LossSettings",
    "PolicyLossSpec",
    "aggregate_loss",
    "available_policy_losses",
    "check_policy_loss_hyperparams",
    "get_policy_loss",
    "per_token_policy_loss",
    "policy_loss",
    "policy_loss_defaults",
    "policy_loss_with",
    "register_policy_loss",
]


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
    if (top_entropy_quantile is not None or entropy_coef != 0) and entropy is None:
        raise ValueError("top_entropy_quantile and entropy_coef need the policy's entropy (`entropy`)")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs the reference's logprobs (`ref_logprobs`)")
    if top_entropy_quantile is not None and entropy is not None:
        low_entropy_BT = ~top_entropy_mask(entropy.detach(), mask_BT, top_entropy_quantile) & keep_BT
        per_token["entropy/kept_frac"] = ~low_entropy_BT
        dropped_BT = dropped_BT | low_entropy_BT
    tensors: dict[str, Optional[torch.Tensor]] = {
        "logprobs": logprobs, "old_logprobs": old_BT, "advantages": advantages_BT, "mask": mask_BT
    }  # fmt: skip
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
    if kl_beta > 0 and ref_logprobs is not None:
        kl_BT = k3(torch.where(keep_BT, ref_logprobs.detach(), 0.0), logprobs)
        loss_BT = loss_BT + kl_beta * kl_BT
        metrics["ref_kl"] = masked_mean(kl_BT.detach(), mask_BT)
    if entropy_coef != 0 and entropy is not None:
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


@dataclass(frozen=True)
class LossSettings:
    """Everything the loss reads besides its tensors: built once per run from the config
    (`lit_grpo.loop.optimizer_step.loss_settings`), handed whole to `policy_loss_with`."""

    name: str = "grpo"
    """The registered variant (or `module.path:name`)."""
    hyperparams: Mapping[str, Any] = field(default_factory=dict)
    """The variant's hyper-parameters that are set, `kl_beta` included; the others take its defaults."""
    normalization: str = "token_mean"
    """A `LOSS_NORMALIZATIONS` key: how the per-token loss becomes the scalar."""
    correction: str = "tis"
    """The training–inference mismatch correction mode (`lit_grpo.maths.correction`)."""
    correction_params: Mapping[str, Any] = field(default_factory=dict)
    """The correction's parameters that are set; the others take the mode's defaults."""
    off_policy_delta: Optional[float] = None
    """DeepSeek-V3.2's off-policy mask threshold δ (None: off)."""
    top_entropy_quantile: Optional[float] = None
    """Train the policy term on the top-q entropy tokens only (None: all)."""
    entropy_coef: float = 0.0
    """The entropy bonus's coefficient; it moves step by step (`with_entropy_coef`)."""

    @property
    def kl_beta(self) -> float:
        """β of the KL penalty to the reference (> 0: a reference model is needed)."""
        return float(self.hyperparams.get("kl_beta", policy_loss_defaults(self.name)["kl_beta"]))

    @property
    def zero_advantage_trains_nothing(self) -> bool:
        """Whether a sequence whose every advantage is 0 has no gradient under these settings: the
        variant `vanishes_without_advantage`, no KL penalty, no entropy bonus, and no top-entropy
        mask (its quantile is over the tokens of a forward, so the rows present change it)."""
        return (
            get_policy_loss(self.name).vanishes_without_advantage
            and self.kl_beta == 0
            and self.entropy_coef == 0
            and self.top_entropy_quantile is None
        )

    def with_entropy_coef(self, coef: float) -> LossSettings:
        """These settings with this step's entropy-bonus coefficient."""
        return dataclasses.replace(self, entropy_coef=coef)


def policy_loss_with(
    settings: LossSettings,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    sampler_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with its settings in one object: the same tensors, the same result.
    Shapes: [B, T] tensors, advantages [B] or [B, T] -> []."""
    return policy_loss(
        settings.name, logprobs=logprobs, old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs,
        ref_logprobs=ref_logprobs, advantages=advantages, mask=mask, normalization=settings.normalization,
        num_tokens=num_tokens, num_sequences=num_sequences, correction=settings.correction,
        correction_params=settings.correction_params, off_policy_delta=settings.off_policy_delta,
        entropy=entropy, entropy_coef=settings.entropy_coef, top_entropy_quantile=settings.top_entropy_quantile,
        **settings.hyperparams,
    )  # fmt: skip


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
