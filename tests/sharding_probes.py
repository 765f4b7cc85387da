"""Callbacks the sharded-training tests add to real runs (`+callbacks.NAME={_target_:sharding_probes.X,...}`).

Each writes what it saw, per rank, as JSON lines into `out_dir`; the tests read them back. They
gather full tensors from the shards, a collective, so every rank runs them at the same points.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lit_grpo.models.weights import full_named_tensors


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _record(out_dir: str, name: str, rank: int, entry: dict) -> None:
    with (Path(out_dir) / f"{name}_rank{rank}.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")


class SamplerHoldsPolicy(L.Callback):
    """At each step's start (after the previous step's sync), compare this rank's `hf` sampler
    weights with the policy's full weights, gathered from the shards: merged (`lora_sync=merged`,
    or a full fine-tune), or a LoRA policy's own, adapters unmerged (adapter sync: the sampler's
    copy is of the peft model)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.rollout_step == 0:
            return
        if trainer.datamodule.adapter_sync:
            state = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
            policy = {n[len("policy.") :]: _full(t).clone() for n, t in state.items() if n.startswith("policy.")}
        else:
            policy = {name: t.clone() for name, t in full_named_tensors(trainer.strategy.model, prefix="policy.")}
        sampler = trainer.datamodule.sampler.model.state_dict()
        _record(
            self.out_dir,
            "sampler_sync",
            trainer.global_rank,
            {
                "after_step": pl_module.rollout_step,
                "sharded": any(hasattr(p, "full_tensor") for p in pl_module.policy.parameters()),
                "names_missing": sorted(set(sampler) - set(policy)),
                "max_abs_diff": max((sampler[n].float() - t.float()).abs().max().item() for n, t in policy.items()),
                "policy_sum": sum(t.double().sum().item() for t in policy.values()),  # changes when a step trained
                "optimizer_state": sorted(
                    {
                        type(v).__name__
                        for state in trainer.optimizers[0].state.values()
                        for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                    }
                ),
            },
        )


class FrozenStaysFrozen(L.Callback):
    """Whole copies of the policy's parameters at the start; at the end, which of them moved."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = {n: _full(p).detach().clone() for n, p in pl_module.policy.named_parameters()}

    def on_train_end(self, trainer, pl_module) -> None:
        moved, trainable = [], []
        for name, p in pl_module.policy.named_parameters():
            if not torch.equal(_full(p).detach(), self.start[name]):
                moved.append(name)
            if p.requires_grad:
                trainable.append(name)
        _record(self.out_dir, "frozen", trainer.global_rank, {"moved": moved, "trainable": trainable})
