"""The policy's full (unsharded) weights by state-dict name: what a weight sync hands the sampler.

Each training rank has its own sampler, and samplers load `(name, tensor)` pairs of whole
tensors. How to get those depends on how the trainer holds the policy:

- a plain module (one process, DDP): the state dict's own tensors, no copies;
- DTensor parameters (FSDP2 `fully_shard`, Lightning's `ModelParallelStrategy`, tensor
  parallelism): each tensor is all-gathered with `full_tensor()` when the consumer asks for it,
  so a rank holds its shards plus about one full tensor at a time, not the whole model twice;
- FSDP1 (`FullyShardedDataParallel`, Lightning's `FSDPStrategy`): torch's `get_model_state_dict`
  with `full_state_dict=True` and `cpu_offload=False` (with `cpu_offload=True` only rank 0 gets
  the tensors). FSDP1 gathers unit by unit and clones, so here the whole model is materialised
  on every rank at once; FSDP1 offers no simple per-tensor path.

Names and order come from `get_model_state_dict` (the state dict without the `module.` /
`_orig_mod.` / `_fsdp_wrapped_module.` wrapper parts), which is the same on every rank. The order
matters because the gathers are collectives: every rank must consume the iterator in the same
order and to the end. A rank that stops early (its sampler raised) leaves the others blocked in
the next gather until the process-group timeout.

Tied weights (the embedding and the LM head) appear under every name, as in `state_dict()`, so
each engine finds every weight under the name its own model uses (vLLM looks weights up by its
model's names; the `hf` sampler refuses a sync that leaves one of its weights stale). Under
DTensor each name is gathered separately: one extra all-gather of the embedding per sync, in
exchange for a rule that needs no rank to agree with another about which tensors are the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor


def full_named_tensors(model: nn.Module, *, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full tensor)` for each state-dict entry of `model` under `prefix` (stripped), lazily.

    Call it on every rank and consume it to the end on every rank (see the module docstring).
    `prefix` selects one submodule of a wrapper, e.g. `full_named_tensors(trainer.strategy.model,
    prefix="policy.")` works under every Lightning strategy, FSDP1 included (there the FSDP root
    is the whole LightningModule, not `pl_module.policy`). Tensors are detached; plain ones share
    storage with the parameters, so copy them before the next optimizer step if you keep them.
    A LoRA (peft) policy streams as its base model: adapted weights merged, base names.
    """
    return PolicyWeights(model, prefix=prefix).named_tensors()


class PolicyWeights:
    """`full_named_tensors` of one model for a whole run: how it is held (sharded or not, LoRA) is
    looked up once, not at every weight sync (on the tiny model the look-up costs more than the
    copy). Build it once the strategy has wrapped the model; each `named_tensors()` streams the
    weights as they are at that moment."""

    def __init__(self, model: nn.Module, *, prefix: str = "") -> None:
        self.model, self.prefix = model, prefix
        fsdp1_modules = FullyShardedDataParallel.fsdp_modules(model)
        _reject_fsdp1_above(model, fsdp1_modules)
        self._fsdp1 = bool(fsdp1_modules)
        self._lora_layers = _lora_layers(model, prefix)
        self._plain: Optional[list[tuple[str, torch.Tensor]]] = None
        """Nothing sharded: the state dict's own parameters and buffers under `prefix` (their
        objects, so each sync reads their data as it is then)."""
        if not self._fsdp1 and not any(isinstance(p, DTensor) for p in model.parameters()):
            # `get_model_state_dict` costs ~4 ms more per sync on the tiny model, a tenth of its whole step.
            entries = ((_unwrapped(name), t) for name, t in model.state_dict(keep_vars=True).items())
            self._plain = [(name[len(prefix) :], t) for name, t in entries if name.startswith(prefix)]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, full tensor)` pairs, lazily; on every rank, consumed to the end (a collective when sharded)."""
        stream: Iterator[tuple[str, torch.Tensor]]
        if self._plain is not None:
            stream = ((name, tensor.detach()) for name, tensor in self._plain)
        else:
            # FSDP1: one collective over the whole wrapped model (the reference too, when it sits
            # inside), run here at the call so that every rank runs it at the same point.
            full = StateDictOptions(full_state_dict=True, cpu_offload=False) if self._fsdp1 else None
            stream = _stream(get_model_state_dict(self.model, options=full), self.prefix)
        return _merge_lora(stream, self._lora_layers)

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA policy's adapters alone, named as peft saves them (`lit_grpo.models.lora.adapter_tensors`);
        on every rank, consumed to the end (a sharded policy gathers its whole state)."""
        from lit_grpo.models.lora import adapter_tensors

        if self._plain is not None:
            return adapter_tensors((name, tensor.detach()) for name, tensor in self._plain if ".lora_" in name)
        full = StateDictOptions(full_state_dict=True, cpu_offload=False) if self._fsdp1 else None
        return adapter_tensors(_stream(get_model_state_dict(self.model, options=full), self.prefix))


def _lora_layers(model: nn.Module, prefix: str) -> dict:
    from lit_grpo.models.lora import lora_layers

    return lora_layers(model, prefix)


def _merge_lora(stream: Iterator[tuple[str, torch.Tensor]], layers: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA policy's stream as its base model's (`lit_grpo.models.lora`): samplers load base names only."""
    from lit_grpo.models.lora import merged_lora_tensors

    return merged_lora_tensors(stream, layers) if layers else stream


_WRAPPERS = ("module.", "_orig_mod.")  # DDP and torch.compile, as get_model_state_dict drops them


def _unwrapped(name: str) -> str:
    while name.startswith(_WRAPPERS):
        name = name.split(".", 1)[1]
    return name


def _stream(state: dict[str, Any], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The entries under `prefix`, each DTensor gathered only when the consumer asks for it."""
    for name, tensor in state.items():
        if not name.startswith(prefix):
            continue
        full = _gather(tensor) if isinstance(tensor, DTensor) else tensor
        yield name[len(prefix) :], full.detach()
        del tensor, full  # drop this rank's reference before gathering the next one


def _gather(tensor: DTensor) -> torch.Tensor:
    """The whole tensor on every rank of its mesh (a collective)."""
    if tensor.device.type != tensor.device_mesh.device_type:  # CPU-offloaded shards of a GPU mesh
        tensor = cast(DTensor, tensor.to(tensor.device_mesh.device_type))  # a DTensor's `to` is one
    with torch.no_grad():  # here, not around the yield: grad mode would leak into the consumer
        return tensor.full_tensor()


def _reject_fsdp1_above(model: nn.Module, fsdp1_modules: Sequence[nn.Module]) -> None:
    """Fail loudly when an FSDP1 wrapper above `model` owns some of its parameters (they hold shards)."""
    owned = {id(p) for m in fsdp1_modules for p in m.parameters()}
    if any(getattr(p, "_fsdp_flattened", False) and id(p) not in owned for p in model.parameters()):
        raise ValueError(
            f"the parameters of this {type(model).__name__} are sharded by a FullyShardedDataParallel wrapper "
            "around it; pass that wrapper with a prefix instead, e.g. "
            "full_named_tensors(trainer.strategy.model, prefix='policy.')"
        )


def first_nonfinite(model: nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or an infinity (this rank's shard), or None."""
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if not bool(torch.isfinite(local.detach()).all()):
            return name
    return None
