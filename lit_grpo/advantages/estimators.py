"""The advantage estimators that score a group's samples one reward each, as pure float64 tensor
functions, each registered here with its defaults (`lit_grpo.advantages.registry`).

Per group (`rewards_G` [G] -> [G]): `grpo_advantages` and `dr_grpo_advantages` (the group-relative
maths of `group_advantages`), `rloo_advantages`, `passk_advantages`, `gdpo_advantages`
(`rewards_GR` [G, R] -> [G]). Per batch (`rewards_P`, the step's groups, each [G_p], -> one [G_p]
each): `batch_std_advantages`, `reinforce_pp_advantages`. IGPO's turn-level credit is
`lit_grpo.advantages.igpo`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from lit_grpo.advantages.registry import positive, positive_int, register_advantage, rewards_uniform, uniform_rows

_STD_FLOOR = 1e-8
ADVANTAGE_SCALES = ("std", "none")
"""`group_advantages`' scales: `std` is the `grpo` entry, `none` the `dr_grpo` entry."""


# ---------------------------------------------------------------------------------- group-relative maths


def group_advantages(rewards_PG: torch.Tensor, scale: str = "std", eps: float = _STD_FLOOR) -> torch.Tensor:
    """Advantages of P groups of G rewards each.

    `std`: A = (r - mean) / (std + eps), with std the unbiased (n - 1) standard deviation of the
    group; `none`: A = r - mean. A uniform group (reward spread below `UNIFORM_TOLERANCE`, 1e-6:
    the reward filter's test) or one whose std is below `eps` (default 1e-8) gets zeros.
    Shape: [P, G] -> [P, G], float32.
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
    uniform_P1 = (std_P1 < eps) | uniform_rows(rewards_PG)
    if scale == "std":
        centred_PG = centred_PG / (std_P1 + eps)
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


@register_advantage("grpo", checks={"eps": positive}, eps=_STD_FLOOR)
def grpo_advantages(rewards_G: torch.Tensor, *, eps: float) -> torch.Tensor:
    """A = (r - mean) / (std + eps), std the group's unbiased (n - 1) standard deviation; a group
    whose std is below eps (default 1e-8: equal rewards) gets zeros (`group_advantages`, `std`)."""
    return group_advantages(rewards_G[None], "std", eps)[0]


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: A = r - mean, no scaling; a group whose std is below 1e-8 gets zeros (`group_advantages`, `none`)."""
    return group_advantages(rewards_G[None], "none")[0]


# ---------------------------------------------------------------------------------- beyond GRPO


def _need_two(rewards_G: torch.Tensor, name: str) -> None:
    if rewards_G.ndim < 1 or rewards_G.shape[0] < 2:
        raise ValueError(f"{name} needs a group of at least 2 rewards, got shape {tuple(rewards_G.shape)}")


def _scaled_std(values: torch.Tensor) -> torch.Tensor:
    """The unbiased (n - 1) std of a 1-D tensor, computed on values scaled by their largest
    magnitude (squares near 1e200 would overflow float64)."""
    magnitude = values.abs().max()
    if magnitude == 0:
        return magnitude
    return (values / magnitude).std(unbiased=True) * magnitude


@register_advantage("rloo")
def rloo_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out: A_i = r_i - mean_{j != i} r_j = G / (G - 1) · (r_i - mean).
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs"; TRL's `RLOOTrainer`, verl's `rloo`. A uniform group gets zeros."""
    _need_two(rewards_G, "rloo")
    g = rewards_G.shape[0]
    centred = (rewards_G - rewards_G.mean()) * (g / (g - 1))
    return torch.zeros_like(centred) if rewards_uniform(rewards_G.tolist()) else centred


def _centred_groups(rewards_P: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each group minus its mean, zeros for a uniform group."""
    out = []
    for rewards_G in rewards_P:
        _need_two(rewards_G, "a batch-level advantage")
        uniform = rewards_uniform(rewards_G.tolist())
        out.append(torch.zeros_like(rewards_G) if uniform else rewards_G - rewards_G.mean())
    return out


def _divided(centred_P: list[torch.Tensor], std: torch.Tensor, eps: float) -> list[torch.Tensor]:
    if std < eps:  # every group uniform: nothing to scale
        return [torch.zeros_like(c) for c in centred_P]
    return [c / (std + eps) for c in centred_P]


@register_advantage("batch_std", batch=True, checks={"eps": positive}, eps=_STD_FLOOR)
def batch_std_advantages(rewards_P: Sequence[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """Group mean, batch std: A = (r - mean_group) / (std_batch(r) + eps), std_batch the unbiased
    std of every reward of the step's groups (LitePPO, Liu et al. 2025 "Part I: Tricks or Traps? A
    Deep Dive into RL for LLM Reasoning": "group-level mean, batch-level std"; ROLL's and AReaL's
    group mean with batch std, TRL's `scale_rewards="batch"`). The batch is this
    rank's accepted groups of the step; under DDP each rank divides by its own batch's std. A
    uniform group gets zeros; with one group in the batch this is `grpo`."""
    centred = _centred_groups(rewards_P)
    return _divided(centred, _scaled_std(torch.cat(list(rewards_P))), eps)


@register_advantage("reinforce_pp", batch=True, checks={"eps": positive}, eps=_STD_FLOOR)
def reinforce_pp_advantages(rewards_P: Sequence[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++"; OpenRLHF `reinforce_baseline`, verl
    `reinforce_plus_plus_baseline`): c = r - mean_group, then c whitened over the batch,
    A = (c - mean_batch(c)) / (std_batch(c) + eps), std unbiased. Not `batch_std`: the std is of
    the centred rewards, not of the raw ones (they differ when the groups' means differ). Both
    peers whiten over the batch's response tokens (each sequence weighs its length); here each
    sequence weighs one, so mean_batch(c) is 0 (every group's c sums to 0) and A = c / std_batch(c).
    The batch is this rank's accepted groups of the step (under DDP, per rank). A uniform group
    gets zeros."""
    centred = _centred_groups(rewards_P)
    return _divided(centred, _scaled_std(torch.cat(centred)), eps)


@register_advantage("passk", binary_rewards=True, checks={"k": positive_int}, k=4)
def passk_advantages(rewards_G: torch.Tensor, k: int) -> torch.Tensor:
    """Pass@k advantages, analytic, for binary rewards (Chen et al. 2025, "Pass@k Training for
    Adaptively Balancing Exploration and Exploitation of Large Reasoning Models", its analytic
    derivation). With N samples of which N_neg failed, the group's pass@k and its std are
        R = 1 - C(N_neg, k) / C(N, k),  σ = sqrt(R (1 - R)),
    and each sample's advantage is
        A_pos = (1 - R) / σ,   A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / σ.
    k = 1 is GRPO with the population std. A group all-correct or all-wrong (σ = 0) gets zeros; a
    group smaller than k (samples dropped by the rollout) uses k = N. Rewards must be 0 or 1."""
    _need_two(rewards_G, "passk")
    if not torch.all((rewards_G == 0) | (rewards_G == 1)):
        raise ValueError(f"passk needs binary rewards (0 or 1), got {sorted(set(rewards_G.tolist()))[:6]}")
    n = rewards_G.shape[0]
    k = min(int(k), n)
    n_neg = int((rewards_G == 0).sum())
    pass_at_k = 1.0 - math.comb(n_neg, k) / math.comb(n, k)
    sigma = math.sqrt(pass_at_k * (1.0 - pass_at_k))
    if sigma == 0.0:
        return torch.zeros_like(rewards_G)
    negative_share = math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1) if n_neg >= 1 else 0.0
    a_pos = (1.0 - pass_at_k) / sigma
    a_neg = (1.0 - pass_at_k - negative_share) / sigma
    return torch.where(rewards_G == 1, torch.full_like(rewards_G, a_pos), torch.full_like(rewards_G, a_neg))


def _z_scored(values_G: torch.Tensor, eps: float) -> torch.Tensor:
    """(v - mean) / (std + eps), unbiased std; zeros for a uniform column."""
    if rewards_uniform(values_G.tolist()):
        return torch.zeros_like(values_G)
    centred = values_G - values_G.mean()
    return centred / (_scaled_std(centred) + eps)


@register_advantage("gdpo", components=True, checks={"eps": positive}, weights=None, eps=_STD_FLOOR)
def gdpo_advantages(rewards_GR: torch.Tensor, weights: Optional[Sequence[float]], eps: float) -> torch.Tensor:
    """GDPO (Liu et al. 2026, NVIDIA, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization"): each of the R reward components z-scored
    within the group on its own, summed with `weights` (None: all 1), and the sum z-scored again:
        A = z(Σ_r w_r · z(rewards_GR[:, r])),  z(x) = (x - mean) / (std + eps), std unbiased.
    The paper's second normalization is over the batch; here it is over the group. A uniform
    component contributes zeros. [G, R] (or [G]: one component) -> [G]. In training the columns are
    `reward.fn`'s components (`Advantage.component_keys`), the weights `reward.weights`."""
    if rewards_GR.ndim == 1:
        rewards_GR = rewards_GR[:, None]
    if rewards_GR.ndim != 2:
        raise ValueError(f"gdpo needs rewards of shape [G, R], got {tuple(rewards_GR.shape)}")
    _need_two(rewards_GR, "gdpo")
    r = rewards_GR.shape[1]
    weights = [1.0] * r if weights is None else [float(w) for w in weights]
    if len(weights) != r:
        raise ValueError(f"gdpo: {len(weights)} weights for {r} reward components")
    summed_G = sum(w * _z_scored(rewards_GR[:, i], eps) for i, w in enumerate(weights))
    return _z_scored(torch.as_tensor(summed_G, dtype=torch.float64), eps)
