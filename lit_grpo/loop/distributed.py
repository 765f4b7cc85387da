"""The few collectives the loop needs, as no-ops in a single process.

Every rank must call each of them in the same order (they are collectives). They use
`torch.distributed` directly: Lightning's strategies set the process group up (gloo on CPU,
NCCL on GPUs) before any training hook runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A reduced copy of `tensor` over all ranks (`sum`, `max` or `min`); the tensor itself alone."""
    if not is_distributed():
        return tensor
    out = tensor.detach().clone()
    if dist.get_backend() == "nccl" and not out.is_cuda:  # NCCL reduces GPU tensors only
        out = out.cuda()
    dist.all_reduce(out, op=_OPS[op])
    return out.to(tensor.device)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; `[obj]` alone."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
