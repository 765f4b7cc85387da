"""Drops prompt groups that carry no learning signal (the seeds' `dynamic_filter_fn`)."""

from __future__ import annotations

from typing import Callable, Optional

import lightning as L

from lit_grpo.types import PromptGroup


def has_reward_variance(group: PromptGroup) -> bool:
    """True unless every reward in the group is the same (then every advantage is zero)."""
    return len(set(group.rewards)) > 1


class UniformRewardFilter(L.Callback):
    """Registers a group predicate with the rollout data module; rejected groups are counted in
    `filter/dropped_groups` and replaced by fresh rows.

    `predicate` (PromptGroup -> bool, True = keep) replaces the default uniform-reward test; from
    config, give it as `{_target_: my_module.my_fn, _partial_: true}` or a dotted path string.
    """

    def __init__(self, predicate: Optional[Callable[[PromptGroup], bool] | str] = None) -> None:
        if isinstance(predicate, str):
            from hydra.utils import get_method

            predicate = get_method(predicate)
        self.predicate = predicate or has_reward_variance

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if self.predicate not in datamodule.group_filters:
            datamodule.add_group_filter(self.predicate)
