"""Keeps every step's logged scalars in memory: the run summary and the tests read them."""

from __future__ import annotations

import lightning as L

from lit_grpo.module import trained


class MetricHistory(L.Callback):
    """`steps[i]` holds the scalar metrics logged at rollout step i (after that step's callbacks)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not trained(outputs):
            return
        self.steps.append(dict(pl_module.step_metrics))

    def state_dict(self) -> dict:
        return {"steps": [dict(s) for s in self.steps]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = [dict(s) for s in state_dict["steps"]]

    def series(self, key: str) -> list[float]:
        return [s[key] for s in self.steps if key in s]
