"""Training-health signals logged every step: trainer–sampler drift and the shape of the rollouts.

Pure functions, no `.item()` (a GPU sync per micro-batch): `drift_metrics` works on `[B, T]`
tensors inside the training step (`GRPOModule._optimizer_step`), `rollout_health` on the plain
lists a `RolloutRecord` carries (`lit_grpo.rollouts.pipeline.rollout_metrics`).

Drift compares two logprobs of the same sampled tokens: π_sampler, what the sampler reported
(`RolloutSample.logprobs`, the behaviour policy), and π_trainer, the trainer's logprob under
the policy before this step's update (`old_logprobs` of the loss). With an exact sampler both
are equal and every drift metric is 0 (up to float noise).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from lit_grpo.maths.correction import get_correction
from lit_grpo.maths.loss_terms import masked_means

# exp() of a log-ratio beyond ±20 only overflows; the same clamp as the loss's ratio and the correction's.
_LOG_RATIO_CLAMP = 20.0


def drift_tis_cap(correction: str, params: Mapping[str, Any]) -> float:
    """The cap `drift/over_tis_cap_frac` compares against: the correction's `cap` if it takes one
    (configured, else its registered default), else the default TIS cap (5.0)."""
    defaults = get_correction(correction).defaults
    return float(params.get("cap", defaults.get("cap", get_correction("tis").defaults["cap"])))


def drift_metrics(
    trainer_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, *, tis_cap: float
) -> dict[str, torch.Tensor]:
    """Token means, over the tokens where `mask` is 1, of the trainer–sampler drift:

    - `drift/k1` = mean(π_sampler − π_trainer): the naive (k1) estimate of KL(sampler ‖ trainer)
      from tokens drawn from the sampler; signed, so it can be negative on a batch.
    - `drift/k3` = mean(exp(r) − 1 − r) with r = π_trainer − π_sampler (r clamped to ±20;
      computed as expm1(r) − r): the k3 estimate of the same KL, >= 0 on every token.
    - `drift/over_tis_cap_frac` = the fraction of tokens whose per-token importance weight
      exp(π_trainer − π_sampler) exceeds `tis_cap` (what `correction=tis` truncates at `level=token`,
      where it equals `correction/capped_frac`).

    Masked-out positions may hold anything (padding): they are zeroed before any arithmetic.
    Every value is 0 when no token is masked in. Detached scalars.
    Shapes: [B, T], [B, T], [B, T] -> dict of [].
    """
    return masked_means(
        drift_per_token(trainer_logprobs_BT, sampler_logprobs_BT, mask_BT, tis_cap=tis_cap), mask_BT.float()
    )


def drift_per_token(
    trainer_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, *, tis_cap: float
) -> dict[str, torch.Tensor]:
    """The per-token terms whose masked means are `drift_metrics` (for a caller that reduces them
    with other metrics in one `masked_means`); 0 on masked-out positions except the cap flag,
    which the mask removes. Shapes: [B, T] each -> dict of [B, T]."""
    # One `where` after the difference: it selects, so padding's -inf - -inf = nan never leaks.
    r_BT = torch.where(mask_BT > 0, trainer_logprobs_BT.detach().float() - sampler_logprobs_BT.detach().float(), 0.0)
    r_BT = r_BT.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return {
        "drift/k1": -r_BT,
        "drift/k3": torch.expm1(r_BT) - r_BT,  # expm1: >= 0 even at float noise
        "drift/over_tis_cap_frac": torch.exp(r_BT) > tis_cap,  # `correction=tis`'s own test at level=token
    }


def learning_signal(advantages: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Whether any trained token (mask > 0) carries a non-zero advantage: without one, the policy
    term of the loss has no gradient and an optimizer step would follow only the KL and entropy
    terms, float noise that Adam scales up to a near full learning-rate step. Every estimator gives
    exactly 0 to a sample without signal (a uniform group, `rewards_uniform`), so the test is exact.
    A NaN advantage counts as signal: the step's non-finite check is the one that handles it.
    Shapes: advantages [B] (per sequence) or [B, T] (per token, IGPO's), mask [B, T] -> [] bool."""
    return rows_with_signal(advantages, mask_BT).any()


def rows_with_signal(advantages: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Each row's `learning_signal`: whether any of its trained tokens carries a non-zero advantage.
    Shapes: advantages [B] or [B, T], mask [B, T] -> [B] bool."""
    advantages_BT = advantages[:, None] if advantages.dim() == 1 else advantages
    return ((advantages_BT != 0) & (mask_BT > 0)).any(dim=1)


def finish_reason_key(reason: str) -> str:
    """The metric-key form of a finish reason: anything but letters, digits and `_` becomes `_`."""
    return re.sub(r"[^A-Za-z0-9_]", "_", str(reason)) or "_"


def rollout_health(zero_spread: list[bool], finish_reasons: list[str], trained_tokens: list[int]) -> dict[str, float]:
    """The rollout-health metrics of a step from lists pooled over every rank's record:

    - `rollout/zero_spread_frac`: of the sampled groups with at least two runs (filtered ones
      included, before any filter drops them), the fraction whose run rewards are all equal
      (no learning signal: every advantage is 0). 0.0 when there is no such group.
    - `rollout/truncated_frac`: of the trained sequences, the fraction whose `finish_reason` is
      `length` (hit the token limit). 0.0 when nothing trained.
    - `rollout/length_<reason>`: per finish reason seen among the trained sequences (`stop`,
      `length`, whatever a rollout reports, made key-safe by `finish_reason_key`), the mean of
      their trained tokens (the loss-mask sum: the tokens the policy generated). Absent for a
      reason no trained sequence had this step.

    `zero_spread` has one flag per such group; `finish_reasons` and `trained_tokens` are parallel,
    one entry per trained sequence.
    """
    metrics = {
        "rollout/zero_spread_frac": sum(map(bool, zero_spread)) / max(len(zero_spread), 1),
        "rollout/truncated_frac": sum(r == "length" for r in finish_reasons) / max(len(finish_reasons), 1),
    }
    by_reason: dict[str, list[int]] = {}
    for reason, n in zip(finish_reasons, trained_tokens):
        by_reason.setdefault(f"rollout/length_{finish_reason_key(reason)}", []).append(n)
    metrics.update({key: sum(ns) / len(ns) for key, ns in sorted(by_reason.items())})
    return metrics
