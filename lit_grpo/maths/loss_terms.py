"""The pieces every policy loss shares: the ratio, k3 KL, masked means, aggregation.

Pure tensor functions, no `.item()` (a GPU sync per micro-batch). `lit_grpo.maths.losses` builds the
registered variants from them; the formulas are tabled in docs/guides/policy-losses.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# exp() of a log-ratio beyond ±20 only overflows or underflows; the clamp keeps gradients finite.
_LOG_RATIO_CLAMP = 20.0


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the tokens where `mask` is 1; 0 when no token is masked in.

    Shape: [B, T], [B, T] -> [].
    """
    return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def masked_frac(flags_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The share of the masked-in tokens where `flags` holds (a clip fraction). Shape: [B, T], [B, T] -> []."""
    return masked_mean(flags_BT.to(mask_BT.dtype), mask_BT)


def masked_means(values: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """`masked_mean` of each value, as one stacked reduction (a handful of ops for any number of
    metrics, where one `masked_mean` each costs five: these run every micro-batch). Values are
    cast to the mask's dtype; the results are views of one vector.

    Shape: {name: [B, T]}, [B, T] -> {name: []}.
    """
    if not values:
        return {}
    stacked_KBT = torch.stack([v.to(mask_BT.dtype) for v in values.values()])
    means_K = (stacked_KBT * mask_BT).sum(dim=(1, 2)) / mask_BT.sum().clamp(min=1)
    return dict(zip(values, means_K.unbind()))


def masked_seq_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean of `x` over its masked-in tokens; 0 for a sequence with none.

    Shape: [B, T], [B, T] -> [B].
    """
    return (x_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)


def ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Token importance ratio r = exp(clamp(π - old, -20, 20)). Shape: [B, T]."""
    return torch.exp((logprobs_BT - old_logprobs_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def k3(ref_logprobs_BT: torch.Tensor, logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π || ref): exp(ref - π) - (ref - π) - 1, always >= 0.

    Differentiable through both arguments (callers detach `ref`). Shape: [B, T].
    """
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1


Count = int | float | torch.Tensor | None


def _token_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: Count, num_sequences: Count) -> torch.Tensor:
    denominator = mask_BT.sum().clamp(min=1) if num_tokens is None else num_tokens
    return (loss_BT * mask_BT).sum() / denominator


def _seq_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: Count, num_sequences: Count) -> torch.Tensor:
    denominator = loss_BT.shape[0] if num_sequences is None else num_sequences
    return masked_seq_mean(loss_BT, mask_BT).sum() / denominator


def _sum(loss_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: Count, num_sequences: Count) -> torch.Tensor:
    return (loss_BT * mask_BT).sum()


LOSS_NORMALIZATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Count, Count], torch.Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean": _seq_mean,
    "sum": _sum,
}
"""`loss_normalization` -> its reduction `(loss_BT, mask_BT, num_tokens, num_sequences) -> []`;
`aggregate_loss` documents each."""


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    num_tokens: Count = None,
    num_sequences: Count = None,
) -> torch.Tensor:
    """Reduce a per-token loss to the scalar that is backpropagated.

    `token_mean`: Σ m·L / Σ m; pass `num_tokens` (the masked tokens of the whole optimizer step,
    across micro-batches and ranks) to use it as the denominator instead, so that accumulated
    micro-batch gradients equal the full-batch one. `seq_mean`: the mean over sequences of each
    sequence's masked token mean (a sequence with no masked token contributes 0), divided by
    `num_sequences` if given, else B. `sum`: Σ m·L.
    Shape: [B, T], [B, T] -> [].
    """
    if mode not in LOSS_NORMALIZATIONS:
        raise ValueError(f"unknown loss normalization {mode!r}; valid: {', '.join(LOSS_NORMALIZATIONS)}")
    return LOSS_NORMALIZATIONS[mode](loss_BT, mask_BT.to(loss_BT.dtype), num_tokens, num_sequences)
