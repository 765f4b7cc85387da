"""Histograms of each step's rewards, for the loggers that draw them (TensorBoard, W&B)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger


class RewardHistogram(L.Callback):
    """Every `every_n_steps` rollout steps, the trained batch's rewards (this rank's) as `reward/histogram`."""

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not outputs or self.every_n_steps <= 0 or pl_module.rollout_step % self.every_n_steps:
            return  # no step was trained (the stream ended), or not this step
        step = pl_module.rollout_step - 1  # the 0-based index the step's scalars are logged at
        rewards = pl_module.last_step.rewards_B
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_histogram("reward/histogram", rewards, global_step=step)
            elif isinstance(logger, WandbLogger):
                import wandb

                logger.experiment.log(
                    {"reward/histogram": wandb.Histogram(rewards.numpy()), "trainer/global_step": step}
                )
