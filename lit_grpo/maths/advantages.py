"""Group-relative advantages: pure tensor functions.

GRPO normalizes each reward by its group's mean and (unbiased) standard deviation; Dr. GRPO
(`scale="none"`) only centres it. A group whose rewards are all equal carries no signal and gets
all-zero advantages (it is usually dropped earlier by the uniform-reward filter).
"""

from __future__ import annotations

import torch

_STD_FLOOR = 1e-8
ADVANTAGE_SCALES = ("std", "none")


def group_advantages(rewards_PG: torch.Tensor, scale: str = "std") -> torch.Tensor:
    """Advantages of P groups of G rewards each.

    `std`: A = (r - mean) / (std + 1e-8), std unbiased; `none`: A = r - mean. Groups whose std
    is below 1e-8 get zeros. Shape: [P, G] -> [P, G].
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: {', '.join(ADVANTAGE_SCALES)}")
    if rewards_PG.ndim != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"need rewards of shape [P, G] with G >= 2, got {tuple(rewards_PG.shape)}")
    rewards_PG = rewards_PG.to(torch.float64)
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    # The std of the centred rewards divided by their largest magnitude, scaled back: squares of
    # rewards near 1e200 would overflow float64.
    magnitude_P1 = centred_PG.abs().amax(dim=1, keepdim=True)
    magnitude_P1 = torch.where(magnitude_P1 > 0, magnitude_P1, torch.ones_like(magnitude_P1))
    std_P1 = (centred_PG / magnitude_P1).std(dim=1, unbiased=True, keepdim=True) * magnitude_P1
    uniform_P1 = std_P1 < _STD_FLOOR
    if scale == "std":
        centred_PG = centred_PG / (std_P1 + _STD_FLOOR)
    return torch.where(uniform_P1, torch.zeros_like(centred_PG), centred_PG).float()


def ragged_group_advantages(rewards: list[list[float]], scale: str = "std") -> list[list[float]]:
    """`group_advantages` for groups of different sizes (samples dropped by the rollout), one call
    per distinct size."""
    by_size: dict[int, list[int]] = {}
    for i, group in enumerate(rewards):
        by_size.setdefault(len(group), []).append(i)
    out: list[list[float]] = [[] for _ in rewards]
    for indices in by_size.values():
        advantages = group_advantages(torch.tensor([rewards[i] for i in indices], dtype=torch.float64), scale).tolist()
        for i, row in zip(indices, advantages):
            out[i] = row
    return out
