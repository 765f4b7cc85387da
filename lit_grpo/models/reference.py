"""Moving the KL reference towards the policy (`reference.sync_every`, `reference.mix_alpha`).

TR-DPO's update, `ref ← α·π + (1 − α)·ref`, made in place and without gradient, parameter by
parameter. The reference is a copy of the policy made before any wrapping, so both have the same
parameter names; under FSDP2 both are sharded by the same plan on the same mesh, so each rank mixes
its local shards (after putting back in the sharded state any unit a forward left gathered) and no
collective is needed; under DDP every rank holds the same two models and
makes the same mix, so the ranks' references stay equal.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_grpo.models.sharding import reshard


def mixed(reference: torch.Tensor, policy: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·π + (1 − α)·ref, a new tensor: the maths of `mix_into_` on one tensor (any shape, both alike)."""
    return alpha * policy + (1.0 - alpha) * reference


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage: a DTensor's local shard, a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


@torch.no_grad()
def mix_into_(reference: nn.Module, policy: nn.Module, alpha: float) -> int:
    """Move every parameter of `reference` to α·π + (1 − α)·ref in place; returns how many moved.

    `torch.lerp_(ref, π, α)` computes ref + α·(π − ref), which is π exactly at α = 1 (a copy).
    Raises `RuntimeError` when the two models' parameters differ in names, shapes or sharding
    (they would be mixed with the wrong partners).
    """
    for model in (reference, policy):  # the shards, which persist, not a unit's full weights left by a forward
        reshard(model)
    refs, pols = dict(reference.named_parameters()), dict(policy.named_parameters())
    if refs.keys() != pols.keys():
        differ = sorted(refs.keys() ^ pols.keys())[:4]
        raise RuntimeError(f"the reference and the policy have different parameters (e.g. {differ}): cannot mix them")
    for name, ref in refs.items():
        ref_local, pol_local = _local(ref), _local(pols[name])
        if ref_local.shape != pol_local.shape or getattr(ref, "placements", None) != getattr(
            pols[name], "placements", None
        ):
            raise RuntimeError(f"{name}: the reference's shard {tuple(ref_local.shape)} is not the policy's "
                               f"{tuple(pol_local.shape)} (sharded differently): cannot mix them")  # fmt: skip
        ref_local.lerp_(pol_local.to(ref_local.dtype), alpha)
    return len(refs)
