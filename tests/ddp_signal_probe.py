"""Run by tests/test_ddp.py: two rollout steps on 2 CPU ranks (DDP, gloo) on the fixed batches of
`ddp_grad_probe`, saving each rank's weights before and after each step and the steps' metrics
merged over the ranks (what rank 0 logs).

    python ddp_signal_probe.py <out_dir>

Step 1: rank 0's advantages are all 0, rank 1's are not: the step has a signal, so both ranks
must step. Step 2: no rank's advantage is non-zero: both ranks must skip. Lightning re-runs this
script for rank 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from ddp_grad_probe import fixed_batch
from ddp_health_probe import MergedMetrics
from torch.utils.data import DataLoader

from lit_grpo.loop.module import GRPOModule
from lit_grpo.models.load import load_policy, load_tokenizer
from lit_grpo.run.validate import validate
from lit_grpo.train import compose_config

SIZES = (4, 6)
ZERO_ADVANTAGES = [{0}, {0, 1}]
"""Per step, the ranks whose batch has no signal."""


class Weights(L.Callback):
    """The policy's weights before training and after each step."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights.append({k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.on_train_start(trainer, pl_module)


class SignalData(L.LightningDataModule):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        batches = []
        for step, zero_ranks in enumerate(ZERO_ADVANTAGES):
            batch = fixed_batch(rank + 10 * step, SIZES[rank], self.vocab)
            if rank in zero_ranks:
                batch.advantages_B = torch.zeros_like(batch.advantages_B)
            batches.append(batch)
        return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def main() -> None:
    out = Path(sys.argv[1])
    c = validate(
        compose_config(["batching.micro_batch_size=3", "policy_loss.kl_beta=0.1", "logger=none", f"output_dir={out}"])
    )
    L.seed_everything(0, verbose=False)
    tokenizer = load_tokenizer(c.model)
    weights, merged = Weights(), MergedMetrics()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[weights, merged],
        use_distributed_sampler=False,  # each rank its own batches
    )
    trainer.fit(GRPOModule(load_policy(c.model, tokenizer, c.seed), c), datamodule=SignalData(len(tokenizer)))
    torch.save({"weights": weights.weights, "metrics": merged.steps}, out / f"signal_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
