"""FSDP2 for the policy and its reference: `fully_shard` on each decoder layer, then on the root.

Each decoder layer is one FSDP unit (its parameters are all-gathered just before its forward and
freed after it), so a rank holds its shards plus about one layer's full weights at a time; the
root unit holds what is left (embeddings, the final norm, the LM head, tied or not). Parameters
become `DTensor`s sharded on dim 0 across the mesh, and the optimizer built on them keeps its
state sharded the same way.

Layers are found by the classes a transformers model declares unsplittable (`_no_split_modules`,
e.g. `Qwen2DecoderLayer`): the same classes its authors name for device maps and for FSDP auto
wrapping. A LoRA (peft) policy is sharded through its base model's classes; its adapters live
inside the decoder layers and share their units (FSDP2 keeps frozen and trainable parameters in
one unit; only the trainable ones get gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch < 2.6 kept FSDP2 under _composable
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard


def decoder_layer_classes(model: nn.Module) -> set[str]:
    """The class names of `model`'s decoder layers (`_no_split_modules`), through a peft wrapper."""
    base = get_base() if (get_base := getattr(model, "get_base_model", None)) else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(base).__name__} declares no decoder layer classes (`_no_split_modules`), so it cannot be "
            "sharded layer by layer; use trainer.strategy=ddp for it"
        )
    return names


def shard_per_decoder_layer(model: nn.Module, mesh) -> nn.Module:
    """Apply FSDP2 to `model` in place: each decoder layer, then the root. Returns `model`.

    `mesh` is a 1-D device mesh of the data-parallel ranks (all ranks hold a shard of every tensor).
    """
    classes = decoder_layer_classes(model)
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    if not layers:
        raise ValueError(f"none of {type(model).__name__}'s modules is of its decoder layer classes {sorted(classes)}")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_fsdp2(model: nn.Module) -> bool:
    """Whether `model` is an FSDP2 root (its forward gathers its shards: a collective on every rank)."""
    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit of `model` back in its sharded state (no collective): the root unit stays
    unsharded after a forward without gradient (FSDP2 keeps it for a backward), so its registered
    parameters are then full tensors, not the shards that persist. A no-op for a model not sharded."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A reduction's value as a plain tensor: a DTensor (e.g. the norm of sharded gradients) made whole."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """FSDP2 keeps the gradients of the backwards inside unsharded and unreduced; the next backward
    outside reduce-scatters the sum (one reduction per optimizer step, as DDP's `no_sync`)."""
    assert isinstance(model, FSDPModule), "gradient_sync_off is for an FSDP2-sharded model"
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
