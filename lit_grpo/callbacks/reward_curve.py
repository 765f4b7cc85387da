"""Plots the reward per step, with a moving average, when fit ends."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lit_grpo.run.curves import plot_curves


class RewardCurve(L.Callback):
    """Writes `<output_dir>/reward_curve.png` of `metric` per step (from the run's metric history) when fit ends."""

    def __init__(self, output_dir: str = ".", metric: str = "reward/mean", window: int = 10) -> None:
        self.output_dir, self.metric, self.window = Path(output_dir), metric, window

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        values = pl_module.step_sequence.history.series(self.metric)
        if values and not trainer.fast_dev_run and trainer.is_global_zero:
            plot_curves(
                {self.metric: values},
                self.output_dir / "reward_curve.png",
                title="reward per step",
                ylabel=self.metric,
                window=self.window,
            )
