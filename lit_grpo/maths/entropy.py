"""Entropy controls: the bonus's coefficient over a run (fixed, decaying or adaptive), and the
top-entropy token mask. The bonus itself, `− coef·H_t` per token, is added to the loss in
`lit_grpo.maths.losses.per_token_policy_loss`; the entropy with a gradient comes from
`lit_grpo.maths.logprobs.selected_logprobs_and_entropy(..., entropy_grad=True)`.
"""

from __future__ import annotations

import torch


def scheduled_entropy_coef(step: int, *, coef: float, coef_final: float | None, decay_steps: int) -> float:
    """The bonus coefficient at rollout step `step` (0-based): `coef`, moved linearly to
    `coef_final` over `decay_steps` steps and held there (`coef_final` None or `decay_steps` 0: fixed).
    """
    if coef_final is None or decay_steps <= 0:
        return coef
    return coef + (coef_final - coef) * min(step / decay_steps, 1.0)


def adapted_entropy_coef(coef: float, entropy: float, *, target: float, step_size: float, coef_max: float) -> float:
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312): the coefficient rises by
    `step_size` after a step whose mean entropy was below `target` and falls by it otherwise,
    kept within [0, coef_max]. A bonus that grows only while entropy is low steers it towards the
    target without the fixed bonus's risk of blowing it up."""
    moved = coef + step_size if entropy < target else coef - step_size
    return min(max(moved, 0.0), coef_max)


def top_entropy_mask(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, quantile: float) -> torch.Tensor:
    """The masked tokens whose entropy is in the top `quantile` of these masked tokens ("Beyond the
    80/20 rule", arXiv 2506.01939; TRL's `top_entropy_quantile`): entropy >= the (1 − q) quantile of
    the masked entropies (linear interpolation; ties at the threshold are kept). q = 1 keeps every
    masked token; no masked token keeps none.

    Shape: [B, T], [B, T] -> bool [B, T].
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile}")
    keep_BT = mask_BT > 0
    values = entropy_BT[keep_BT].float()
    if values.numel() == 0:
        return keep_BT
    threshold = torch.quantile(values, 1.0 - quantile)
    return keep_BT & (entropy_BT.float() >= threshold)
