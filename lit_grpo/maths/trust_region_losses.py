"""Newer trust regions than PPO's hard ratio clip: SAPO's soft gate, GMPO's geometric-mean clip,
DPPO's divergence mask, VESPO's Gamma-shaped weight of the sequence ratio.

Plain variant functions with the signature `lit_grpo.maths.loss_registry` describes (keyword-only
`[B, T]` tensors, already zeroed on masked-out tokens, returning `(loss_BT, metrics)`), each
registered here with its defaults; what every variant shares is `lit_grpo.maths.losses`'. Notation as in
docs/guides/policy-losses.md: π the current logprob, old the logprob before this batch's first
update, r = exp(clamp(π - old, -20, 20)), A the advantage, w the TIS weight, sg stop-gradient.
"""

from __future__ import annotations

import torch

from lit_grpo.maths.loss_registry import register_policy_loss
from lit_grpo.maths.loss_terms import masked_frac, masked_mean, masked_seq_mean, ratio

DPPO_DIVERGENCES = ("tv", "kl")
"""What `dppo_divergence` may name: the total-variation or the KL divergence of the two policies'
Bernoulli distributions over the sampled token (DPPO's "Binary-TV" and "Binary-KL")."""
DPPO_DEFAULT_THRESHOLDS = {"tv": 0.2, "kl": 0.05}
"""The threshold each divergence reads when its own is not given (sources in `dppo_loss`)."""

# exp() of the log-ratio is capped at ±20 everywhere in lit_grpo (see loss_terms.ratio).
_LOG_RATIO_CLAMP = 20.0
# 1 - p of a token the model is sure of underflows to 0; the KL's log needs a floor (verl uses 1e-8 too).
_PROB_FLOOR = 1e-8


@register_policy_loss("sapo", vanishes_without_advantage=True, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
def sapo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, sapo_tau_pos, sapo_tau_neg):
    """SAPO, Soft Adaptive Policy Optimization (Qwen, arXiv 2511.20347): a sigmoid gate on the ratio
    in place of the hard clip,

        L = -f(r)·A·w,   f(r) = σ(τ·(r - 1))·4/τ,   τ = sapo_tau_pos if A > 0 else sapo_tau_neg.

    dL/dπ = -4·σ(1 - σ)·r·A·w with σ = σ(τ(r - 1)): at r = 1 the gate's weight 4σ(1 - σ) is 1 (the
    policy gradient), and it decays smoothly as r leaves 1, faster for a larger τ; the paper takes
    τ_neg > τ_pos (defaults 1.0 and 1.05) because negative updates destabilize more. A = 0 takes
    τ_neg, as in verl and TRL. The value at r = 1 is -2A/τ, not -A: only the gradient is the
    policy gradient's. Metric `sapo/gate_weight_mean`: the mean of 4σ(1 - σ). Shape: [B, T].
    """
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"sapo: sapo_tau_pos and sapo_tau_neg must be > 0, got {sapo_tau_pos}, {sapo_tau_neg}")
    ratio_BT = ratio(logprobs, old_logprobs)
    # Built in the ratio's dtype: a where() of two Python floats would round τ to float32.
    tau_BT = torch.full_like(ratio_BT, sapo_tau_neg).masked_fill(advantages > 0, sapo_tau_pos)
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1))
    loss_BT = -gate_BT * (4 / tau_BT) * advantages * tis_weight
    gate_weight_BT = 4 * gate_BT.detach() * (1 - gate_BT.detach())
    return loss_BT, {"sapo/gate_weight_mean": masked_mean(gate_weight_BT, mask)}


@register_policy_loss("gmpo", vanishes_without_advantage=True, eps_clip=0.4, eps_clip_high=0.4)
def gmpo_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, eps_clip, eps_clip_high):
    """GMPO, Geometric-Mean Policy Optimization (arXiv 2507.20673): a sequence's ratio is the
    geometric mean of its token ratios, each clipped PPO-style in log space,

        l_t = clamp(π_t - old_t, -20, 20)
        c_t = -eps_clip       if A < 0 and l_t < -eps_clip        (clipped: constant)
              eps_clip_high   if A > 0 and l_t > eps_clip_high    (clipped: constant)
              l_t             otherwise
        R   = exp(Σ_t m_t·c_t / Σ_t m_t)          (the geometric mean of the clipped ratios)
        L_t = -A·exp(c_t - sg(c_t) + sg(log R))·w_t

    so every token's value is the sequence's -R·A·w and its gradient -R·A·w·∇π_t (0 where c_t is
    clipped). With `loss_normalization=seq_mean` the gradient is that of the paper's -R·A per
    sequence, R's own ∇R = R·mean_t ∇c_t; `token_mean` weighs each sequence by its length, as
    GSPO-token does here. With token-level TIS weights each token's gradient term carries its own
    w_t (the value's derivative would spread the sequence's mean weight); `correction.level=sequence`
    gives every token of a sequence one weight, min(exp(mean_t d_t), cap). Per-token advantages
    (IGPO) stay per token: token t's term is -R·A_t·w_t. The paper's default range is (-0.4, 0.4)
    in log space (ratios within [e^-0.4, e^0.4]), hence eps_clip = eps_clip_high = 0.4; a token
    exactly on an edge is not clipped. `clip_frac`: clipped tokens; `ratio_mean`: the mean of R over
    tokens. Shape: [B, T].

    verl's `geo_mean` (core_algos.compute_policy_loss_geo_mean; its clip_ratio_low/high are these
    log-space ε) clips the same way but (1) takes one advantage per sequence, the masked mean of
    A_t, so per-token advantages are averaged before they meet R (its code supports sequence-level
    advantages only); (2) weighs a sequence by the geometric mean of its token weights as its
    correction already made them, exp(mean_t log(w_t + 1e-10)) with w_t = min(r_t, cap), which is
    at most the truncated geometric mean used here and equal when no token exceeds the cap (a token
    IcePop zeroed scales the sequence by (1e-10)^(1/L) instead of dropping it); (3) averages over
    sequences whatever its `loss_agg_mode` (`loss_normalization=seq_mean` here); (4) does not clamp
    the log-ratio at ±20.
    """
    log_ratio_BT = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    clipped_low_BT = (advantages < 0) & (log_ratio_BT < -eps_clip)
    clipped_high_BT = (advantages > 0) & (log_ratio_BT > eps_clip_high)
    clipped_log_ratio_BT = torch.where(clipped_high_BT, eps_clip_high, log_ratio_BT)
    clipped_log_ratio_BT = torch.where(clipped_low_BT, -eps_clip, clipped_log_ratio_BT)
    log_seq_ratio_B1 = masked_seq_mean(clipped_log_ratio_BT.detach(), mask)[:, None]
    token_log_ratio_BT = clipped_log_ratio_BT - clipped_log_ratio_BT.detach() + log_seq_ratio_B1
    seq_ratio_BT = torch.exp(token_log_ratio_BT)
    metrics = {
        "clip_frac": masked_frac(clipped_low_BT | clipped_high_BT, mask),
        "ratio_mean": masked_mean(seq_ratio_BT.detach(), mask),
    }
    return -seq_ratio_BT * advantages * tis_weight, metrics


@register_policy_loss(
    "dppo",
    vanishes_without_advantage=True,
    dppo_divergence="tv",
    dppo_tv_threshold=None,
    dppo_kl_threshold=None,
    dppo_ratio_cap=20.0,
)
def dppo_loss(
    *,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    tis_weight,
    dppo_divergence,
    dppo_tv_threshold=None,
    dppo_kl_threshold=None,
    dppo_ratio_cap,
):
    """DPPO, Divergence Proximal Policy Optimization ("Rethinking the Trust Region in LLM
    Reinforcement Learning", arXiv 2602.04879; verl's `dppo_tv`/`dppo_kl`, Stable-RL): the ratio
    clip is replaced by a mask of the tokens whose update has left the trust region, measured as a
    divergence between the two policies' probabilities of the sampled token, p = e^π and
    p_old = e^old, rather than as a ratio:

        L = -sg(min(r, dppo_ratio_cap))·π·A·w·keep

    `tv`: D = p - p_old; a token with A > 0 is dropped when D > dppo_tv_threshold, one with A <= 0
    when D < -dppo_tv_threshold. `kl`: D = p_old·log(p_old/p) + (1 - p_old)·log((1 - p_old)/(1 - p)),
    the KL of the Bernoulli(p_old) to Bernoulli(p); a token is dropped when D > dppo_kl_threshold
    and p moved the way A pushes it (p > p_old for A > 0, p < p_old for A <= 0). A token exactly
    at the threshold is kept. The mask is a constant, and the gradient of a kept token is
    -min(r, cap)·A·w·∇π (CISPO's form, without its clip); a dropped token gets none.

    Only the chosen divergence's threshold is read: giving the other one is a ValueError (it would
    be ignored). None takes `DPPO_DEFAULT_THRESHOLDS`: TV 0.2 (verl's `ActorConfig.clip_ratio_low`
    / `_high` default, which its `dppo_tv` reads as the threshold; its DPPO example sets 0.15), KL
    0.05 (verl's DPPO example). `dppo_ratio_cap` 20 is chosen, not inherited: verl's DPPO code falls
    back to 20 when `clip_ratio_c` is missing, but the field always exists, so verl applies
    `ActorConfig.clip_ratio_c` = 3, its dual-clip PPO constant shared with `vanilla`; its DPPO
    example turns the cap off (10000). verl's DPPO code recommends a large cap against the
    truncation bias (citing the paper's §5.4), and a finite one still bounds a rare token whose
    probability rose far inside the band (p_old 1e-4 -> 0.1: a TV of 0.1, a ratio of 1000).
    On-policy with one minibatch r = 1 and no cap binds. Metrics: `clip_frac` (tokens dropped),
    `dppo/divergence_mean` (D over the masked-in tokens), `dppo/ratio_cap_frac` (kept tokens whose
    ratio hit the cap). Shape: [B, T].
    """
    if dppo_divergence not in DPPO_DIVERGENCES:
        raise ValueError(f"dppo: dppo_divergence must be one of {', '.join(DPPO_DIVERGENCES)}, got {dppo_divergence!r}")
    given = {"tv": dppo_tv_threshold, "kl": dppo_kl_threshold}
    ignored = next((d for d in DPPO_DIVERGENCES if d != dppo_divergence and given[d] is not None), None)
    if ignored is not None:
        raise ValueError(
            f"dppo: dppo_{ignored}_threshold is ignored with dppo_divergence={dppo_divergence!r}, which reads "
            f"dppo_{dppo_divergence}_threshold; leave dppo_{ignored}_threshold unset"
        )
    threshold = DPPO_DEFAULT_THRESHOLDS[dppo_divergence] if given[dppo_divergence] is None else given[dppo_divergence]
    if not (threshold > 0 and dppo_ratio_cap > 0):
        raise ValueError(f"dppo: dppo_{dppo_divergence}_threshold and dppo_ratio_cap must be > 0")
    pi_BT = logprobs.detach()
    prob_BT, old_prob_BT = pi_BT.exp(), old_logprobs.exp()
    positive_BT = advantages > 0
    if dppo_divergence == "tv":
        divergence_BT = prob_BT - old_prob_BT
        dropped_BT = torch.where(positive_BT, divergence_BT > threshold, divergence_BT < -threshold)
        divergence_BT = divergence_BT.abs()
    else:
        # log(1 - p) from expm1 keeps precision for p near 1, where 1 - exp(π) cancels.
        log_not_BT = torch.log((-torch.expm1(pi_BT)).clamp(min=_PROB_FLOOR))
        log_not_old_BT = torch.log((-torch.expm1(old_logprobs)).clamp(min=_PROB_FLOOR))
        divergence_BT = old_prob_BT * (old_logprobs - pi_BT) + (1 - old_prob_BT) * (log_not_old_BT - log_not_BT)
        moved_with_advantage_BT = torch.where(positive_BT, prob_BT > old_prob_BT, prob_BT < old_prob_BT)
        dropped_BT = moved_with_advantage_BT & (divergence_BT > threshold)
    ratio_BT = ratio(pi_BT, old_logprobs)
    capped_BT = ~dropped_BT & (ratio_BT > dppo_ratio_cap)
    keep_BT = (~dropped_BT).to(logprobs.dtype)
    loss_BT = -ratio_BT.clamp(max=dppo_ratio_cap) * logprobs * advantages * tis_weight * keep_BT
    metrics = {
        "clip_frac": masked_frac(dropped_BT, mask),
        "dppo/divergence_mean": masked_mean(divergence_BT, mask),
        "dppo/ratio_cap_frac": masked_frac(capped_BT, mask),
    }
    return loss_BT, metrics


@register_policy_loss(
    "vespo",
    vanishes_without_advantage=True,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
)
def vespo_loss(
    *,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    tis_weight,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
):
    """VESPO, Variational sEquence-level Soft Policy Optimization (arXiv 2602.10693; TRL's
    `loss_type="vespo"`): no clip, but a smooth, asymmetric Gamma-shaped weight of the sequence's
    whole importance ratio, W (a product over its tokens, not GSPO's geometric mean),

        log W = clamp(Σ_t m_t·(clamp(π_t - old_t, -20, 20) + log w_t), -20, 20)
        φ(W)  = W^k·e^(λ·(1 - W))     (φ(1) = 1; k, λ = vespo_k_pos, vespo_lambda_pos if A >= 0,
                                       vespo_k_neg, vespo_lambda_neg if A < 0)
        L_t   = -sg(φ(W))·A_t·π_t

    so each token's gradient is -φ(W)·A·∇π_t: REINFORCE's, weighted by φ, which is 1 on-policy,
    peaks at W = k/λ and (for k > 0) falls to 0 on both sides, as W^k for a small W and as
    e^(-λW) for a large one. The defaults (TRL's and the paper's code's) put that peak below 1 for A >= 0 (2/3) and
    above 1 for A < 0 (3/2): a sequence the update already made likelier (W > 1) keeps little of
    a positive advantage's push and most of a negative one's, and the reverse for W < 1.
    The correction's weight w_t (`tis_weight`) is not multiplied onto the loss: it joins the
    product, so W is the ratio to the sampler (as TRL folds its vLLM ratio in), over the tokens
    the correction keeps (a token it drops, w_t = 0, leaves the product and has its own term
    dropped; TRL instead adds log 1e-8 for it, which zeroes the whole sequence's φ). Per-token
    advantages pick k and λ by each token's sign. Metrics: `vespo/phi_mean` (φ over tokens) and
    `vespo/log_ratio_mean` (log W over tokens); `clip_frac` is 0. Shape: [B, T].
    """
    if not (vespo_k_pos >= 0 and vespo_k_neg >= 0):
        raise ValueError(f"vespo: vespo_k_pos and vespo_k_neg must be >= 0, got {vespo_k_pos}, {vespo_k_neg}")
    if not (vespo_lambda_pos > 0 and vespo_lambda_neg > 0):
        raise ValueError(
            f"vespo: vespo_lambda_pos and vespo_lambda_neg must be > 0, got {vespo_lambda_pos}, {vespo_lambda_neg}"
        )
    keep_BT = mask > 0
    log_ratio_BT = (logprobs - old_logprobs).detach().clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    weighted_BT = keep_BT & (tis_weight > 0)
    # log of the weight only where it is positive: log(0) would put -inf (and nan gradients) in the sum
    log_weight_BT = torch.where(weighted_BT, torch.log(torch.where(weighted_BT, tis_weight, 1.0)), 0.0)
    log_terms_BT = torch.where(keep_BT, log_ratio_BT, 0.0) + log_weight_BT
    log_w_B1 = log_terms_BT.sum(dim=1, keepdim=True).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # Built in the ratio's dtype: a where() of two Python floats would round k and λ to float32.
    positive_BT = advantages >= 0
    k_BT = torch.full_like(log_ratio_BT, vespo_k_neg).masked_fill(positive_BT, vespo_k_pos)
    lambda_BT = torch.full_like(log_ratio_BT, vespo_lambda_neg).masked_fill(positive_BT, vespo_lambda_pos)
    phi_BT = torch.exp(k_BT * log_w_B1 + lambda_BT * (1 - torch.exp(log_w_B1)))
    loss_BT = -phi_BT * advantages * logprobs
    metrics = {
        "vespo/phi_mean": masked_mean(phi_BT, mask),
        "vespo/log_ratio_mean": masked_mean(log_w_B1.expand_as(phi_BT), mask),
    }
    return loss_BT, metrics
