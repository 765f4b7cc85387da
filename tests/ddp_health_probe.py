"""Run by tests/test_health.py: one training step on the fixed batches of `ddp_grad_probe`, saving
the step's metrics merged over the ranks (what rank 0 logs).

    python ddp_health_probe.py <out_dir> <devices> <rank batch sizes, e.g. 4,6>

With 2 devices (DDP, gloo), rank r trains on batch r; with 1 device, on the union of the batches.
Lightning re-runs this script for rank 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from ddp_grad_probe import FixedData

from lit_grpo.loop.metrics import merge_step_metrics
from lit_grpo.loop.module import GRPOModule
from lit_grpo.models.load import load_policy, load_tokenizer
from lit_grpo.run.validate import validate
from lit_grpo.train import compose_config


class MergedMetrics(L.Callback):
    """Merges each step's metrics over the ranks (a collective: every rank calls it) and keeps them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = pl_module.last_step
        self.steps.append(merge_step_metrics(step.record, step.train_metrics, step.timings))


def main() -> None:
    out, devices, sizes = Path(sys.argv[1]), int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")]
    c = validate(
        compose_config(
            [
                "batching.micro_batch_size=3",
                "optim.grad_clip_norm=0.5",
                "policy_loss.kl_beta=0",
                "correction.cap=1.5",
                "logger=none",
                f"output_dir={out}",
                "max_steps=1",
            ]
        )
    )
    L.seed_everything(0, verbose=False)
    tokenizer = load_tokenizer(c.model)
    policy = load_policy(c.model, tokenizer, c.seed)
    merged = MergedMetrics()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[merged],
        use_distributed_sampler=False,  # each rank its own fixed batch
    )
    trainer.fit(GRPOModule(policy, c), datamodule=FixedData(sizes, len(tokenizer)))
    if trainer.global_rank == 0:
        (out / f"metrics_world{devices}.json").write_text(json.dumps(merged.steps))
    if torch.distributed.is_initialized():  # gloo's threads joined now, not torn down at the interpreter's exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
