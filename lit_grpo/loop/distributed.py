"""The few collectives the loop needs, as no-ops in a single process.

Every rank must call each of them in the same order (they are collectives). They use
`torch.distributed` directly: Lightning's strategies set the process group up (gloo on CPU,
NCCL on GPUs) before any training hook runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

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


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` as pure FSDP2 (`trainer.strategy=fsdp2`): every process
    is one data-parallel rank holding a shard of each tensor (no tensor parallelism), on GPUs
    (NCCL) or CPUs (gloo).

    `ModelParallelStrategy` asks for the data- and tensor-parallel sizes up front; here they come
    from the world size once the processes exist, so `trainer.devices` and `num_nodes` alone decide
    them, as with DDP. `GRPOModule.configure_model` applies `fully_shard` on the mesh.
    """

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
