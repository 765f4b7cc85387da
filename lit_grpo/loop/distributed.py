"""The few collectives the loop needs, as no-ops in a single process.

Every rank must call each of them in the same order (they are collectives). They use
`torch.distributed` directly: Lightning's strategies set the process group up (gloo on CPU,
NCCL on GPUs) before any training hook runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _set_num_threads_if_needed
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

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


class WatchedLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of the other local ranks (`trainer.devices=N`: this process is rank 0 and
    starts ranks 1.. as copies of its command), without Lightning's child-process observer.

    That observer polls the children every 5 s and, when one ended with any non-zero code, sends
    SIGKILL to the others and to this process: no message naming the rank, no summary, exit 137,
    even when the child ended with a message of its own (a user error, exit 2). Here the children
    are watched by `lit_grpo.loop.peers.PeerWatch` instead (`procs`, read at setup), which names
    the rank and the last checkpoint, and ends the children with this process.
    """

    def launch(self, function: Callable, *args: Any, trainer: Optional[L.Trainer] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _WatchedChildren:
    """A strategy whose subprocess launcher is `WatchedLauncher` (when `watch_children`)."""

    watch_children = True

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        launcher = self._launcher  # type: ignore[has-type]
        if self.watch_children and type(launcher) is _SubprocessScriptLauncher:
            self._launcher = WatchedLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)


class WatchedDDPStrategy(_WatchedChildren, DDPStrategy):
    """Lightning's `DDPStrategy` (`trainer.strategy=ddp`) with `WatchedLauncher`."""


class FSDP2Strategy(_WatchedChildren, ModelParallelStrategy):
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
