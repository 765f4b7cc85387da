"""When the KL reference moves (`reference.sync_every`), and what a checkpoint keeps of it.

`GRPOModule` calls `after_update` at the end of every optimizer step, right after the update was
taken or skipped: every `sync_every`-th update taken mixes the reference towards the policy
(`lit_grpo.models.reference.mix_into_`). A rollout step's reference logprobs are computed once,
before its first optimizer step, so a mix inside a step (with `batching.ppo_minibatches` > 1)
first shows in the next step's KL term. The count is part of the trainer state of a checkpoint,
the reference's weights part of its DCP shards (`lit_grpo.run.state`): a resume is exact.
"""

from __future__ import annotations

from torch import nn

from lit_grpo.config.controls import ReferenceConfig
from lit_grpo.models.reference import mix_into_


class MovingReference:
    """Counts the optimizer updates taken and mixes the reference into place every `sync_every`."""

    def __init__(self, config: ReferenceConfig, reference: nn.Module, policy: nn.Module) -> None:
        self.config = config
        self.reference, self.policy = reference, policy
        self.updates = 0
        """Optimizer updates taken since the start of the run (skipped ones do not move the policy)."""
        self.syncs = 0
        """Mixes made since the start of the run (`reference/syncs`)."""

    def after_update(self, taken: bool) -> bool:
        """The end of an optimizer step; returns whether the reference moved (the same on every rank:
        a step is taken or skipped by all of them together)."""
        if not taken:
            return False
        self.updates += 1
        if self.updates % self.config.sync_every:
            return False
        mix_into_(self.reference, self.policy, self.config.mix_alpha)
        self.syncs += 1
        return True

    def metrics(self) -> dict[str, float]:
        """`reference/syncs`, and `reference/updates_since_sync`: how far the reference trails the policy."""
        return {
            "reference/syncs": float(self.syncs),
            "reference/updates_since_sync": float(self.updates % self.config.sync_every),
        }

    def state_dict(self) -> dict[str, int]:
        return {"updates": self.updates, "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.updates, self.syncs = int(state["updates"]), int(state["syncs"])
