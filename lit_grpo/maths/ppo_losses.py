"""PPO's family of policy losses, each registered here with its defaults: grpo, dapo, gspo, luspo
and cispo (a clipped or clip-weighted ratio), importance_sampling, dro and reinforce (no clip).

Plain variant functions with the signature `lit_grpo.maths.loss_registry` describes (keyword-only
`[B, T]` tensors, already zeroed on masked-out tokens, returning `(loss_BT, metrics)`); what every
variant shares (the mismatch correction, the KL and entropy terms, the aggregation) is
`lit_grpo.maths.losses`'. Notation as in docs/guides/policy-losses.md: π the current logprob, old
the logprob before this batch's first update, r = exp(clamp(π - old, -20, 20)), A the advantage,
w the TIS weight, sg stop-gradient.
"""

from __future__ import annotations

import torch

from lit_grpo.maths.loss_registry import register_policy_loss
from lit_grpo.maths.loss_terms import masked_frac, masked_mean, masked_seq_mean, ratio


def _clipped_surrogate(ratio_BT, advantages_BT, eps_low, eps_high) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate max(-r·A, -clip(r)·A) and where its clipped branch won."""
    unclipped_BT = -ratio_BT * advantages_BT
    clipped_BT = -ratio_BT.clamp(1 - eps_low, 1 + eps_high) * advantages_BT
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT


@register_policy_loss("grpo", vanishes_without_advantage=True, kl_beta=0.001, eps_clip=0.2, eps_clip_high=0.2)
def grpo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """GRPO (DeepSeekMath): PPO's clipped ratio, max(-r·A, -clip(r)·A)·w. Shape: [B, T]."""
    loss_BT, clipped_BT = _clipped_surrogate(ratio(logprobs, old_logprobs), advantages, eps_clip, eps_clip_high)
    return loss_BT * tis_weight, {"clip_frac": masked_frac(clipped_BT, mask)}


@register_policy_loss("dapo", vanishes_without_advantage=True, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None)
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
    metrics = {"clip_frac": masked_frac(clipped_BT, mask), "dual_clip_frac": masked_frac(dual_BT, mask)}
    return loss_BT * tis_weight, metrics


def _sequence_clipped_surrogate(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """GSPO-token's per-token surrogate, its clipped tokens and its sequence ratio R (shared by
    gspo and luspo): R = exp(s), s the masked mean of π - old, written per token as
    exp(π - sg(π) + sg(s)) with the exponent capped at 10. Shapes: [B, T] -> [B, T] each."""
    s_B1 = masked_seq_mean((logprobs - old_logprobs).detach(), mask)[:, None]
    seq_ratio_BT = torch.exp((logprobs - logprobs.detach() + s_B1).clamp(max=10.0))
    loss_BT, clipped_BT = _clipped_surrogate(seq_ratio_BT, advantages, eps_low, eps_high)
    return loss_BT, clipped_BT, seq_ratio_BT


@register_policy_loss("gspo", vanishes_without_advantage=True, eps_clip=3e-4, eps_clip_high=4e-4)
def gspo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """GSPO: one ratio per sequence, R = exp(s) with s the masked mean of π - old, clipped like
    PPO (hence the tiny ε). Written per token as exp(π - sg(π) + sg(s)) so each token's gradient
    is R·∇π_t (GSPO-token) and per-token advantages still work; the exponent is capped at 10.
    `ratio_mean` is the mean of R. Shape: [B, T]."""
    loss_BT, clipped_BT, seq_ratio_BT = _sequence_clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high
    )
    metrics = {"clip_frac": masked_frac(clipped_BT, mask), "ratio_mean": masked_mean(seq_ratio_BT.detach(), mask)}
    return loss_BT * tis_weight, metrics


@register_policy_loss("luspo", vanishes_without_advantage=True, eps_clip=3e-4, eps_clip_high=4e-4)
def luspo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """LUSPO, Length-Unbiased Sequence Policy Optimization (Meituan, arXiv 2602.05261): GSPO with
    each sequence's loss scaled by its length |o| (its masked-in tokens),

        L_t = |o|·max(-R·A_t, -clip(R, 1 - eps_clip, 1 + eps_clip_high)·A_t)·w_t

    with R and the GSPO-token gradient as in `gspo` (each unclipped token's gradient is
    -|o|·R·A·w·∇π_t). With `loss_normalization=seq_mean` (its config's) the loss is
    (1/B)·Σ_i |o_i|·ℓ_i, ℓ_i GSPO's per-sequence term: the paper's objective and TRL's
    `loss_type="luspo"` (per-token loss summed over the sequence, averaged over sequences).
    `token_mean` weighs each sequence by |o|² instead (gspo under `token_mean` already weighs it
    by |o|: that is luspo under `seq_mean` times B / the step's token count). On-policy the
    gradient is -|o|·A per token, REINFORCE's times the length. Metrics as gspo's. Shape: [B, T].
    """
    loss_BT, clipped_BT, seq_ratio_BT = _sequence_clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high
    )
    length_B1 = mask.sum(dim=1, keepdim=True)
    metrics = {"clip_frac": masked_frac(clipped_BT, mask), "ratio_mean": masked_mean(seq_ratio_BT.detach(), mask)}
    return loss_BT * length_B1 * tis_weight, metrics


@register_policy_loss("cispo", vanishes_without_advantage=True, eps_clip=0.2, eps_clip_high=0.28)
def cispo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """CISPO (MiniMax-M1): REINFORCE weighted by the clipped, detached ratio, -sg(clip(r))·π·A·w,
    so clipped tokens still get a gradient. `clip_frac`: ratio outside the band. Shape: [B, T]."""
    ratio_BT = ratio(logprobs, old_logprobs).detach()
    weight_BT = ratio_BT.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss_BT = -weight_BT * logprobs * advantages * tis_weight
    return loss_BT, {"clip_frac": masked_frac(weight_BT != ratio_BT, mask)}


@register_policy_loss("importance_sampling", vanishes_without_advantage=True)
def importance_sampling_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight):
    """Unclipped importance-sampled policy gradient, -r·A·w. Shape: [B, T]."""
    return -ratio(logprobs, old_logprobs) * advantages * tis_weight, {}


@register_policy_loss("dro", dro_beta=0.05)
def dro_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, dro_beta):
    """DRO: REINFORCE with a quadratic proximal penalty instead of a ratio clip,
    -(π·A·w - ½·β·(π - old)²). Shape: [B, T]."""
    return -(logprobs * advantages * tis_weight - 0.5 * dro_beta * (logprobs - old_logprobs) ** 2), {}


@register_policy_loss("reinforce", vanishes_without_advantage=True, uses_tis=False)
def reinforce_loss(*, logprobs, old_logprobs, sampler_logprobs, advantages, mask):
    """REINFORCE as the cookbook writes it: -exp(clamp(π - inf, -20, 20))·A, the ratio to the
    sampler's logprobs (the behaviour policy that generated the tokens), with no clip and no TIS;
    `old` plays no part. With no sampler logprobs, inf = sg(π): the value is -A per token and the
    gradient -A·∇π, plain -π·A's. `ratio_mean` is the mean of this ratio. Shape: [B, T]."""
    behaviour_BT = logprobs.detach() if sampler_logprobs is None else sampler_logprobs
    ratio_BT = ratio(logprobs, behaviour_BT)
    return -ratio_BT * advantages, {"ratio_mean": masked_mean(ratio_BT.detach(), mask)}
