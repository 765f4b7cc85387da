"""Pushes the policy's weights into the sampler every `interval` rollout steps (0: never)."""

from __future__ import annotations

import time

import lightning as L

from lit_grpo.module import trained
import torch


class WeightSync(L.Callback):
    """After every `interval`-th training step, load the policy into the sampler and bump the version.

    `interval=1` keeps sampling on-policy; `interval=0` never syncs (the sampler keeps the base
    weights, for ablations; the version still advances every step so the gate keeps admitting).
    """

    def __init__(self, interval: int = 1) -> None:
        if interval < 0:
            raise ValueError(f"WeightSync interval must be >= 0, got {interval}")
        self.interval = interval

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not trained(outputs):
            return
        if self.interval == 0:
            # No weights move, but the off-policy gate counts steps as versions (else it would
            # stop admitting rows after max_head_offpolicy_versions + 1 steps).
            trainer.datamodule.sync_weights(None)
            return
        if pl_module.rollout_step % self.interval:
            return
        start = time.perf_counter()
        with torch.no_grad():
            trainer.datamodule.sync_weights(pl_module.policy.state_dict().items())
        pl_module.record({"perf/weight_sync_s": time.perf_counter() - start})
