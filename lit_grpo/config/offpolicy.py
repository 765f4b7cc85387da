"""The `offpolicy` group: how sampling overlaps training (synchronous steps, or the off-policy
gate and its lag), how often the policy reaches the sampler, and partial rollouts.

`OffPolicyConfig.__post_init__` checks its fields' ranges and the rules among them;
`lit_grpo.config.run.check_offpolicy` the rules that tie it to the sampler and the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_grpo.config.checks import require


@dataclass
class OffPolicyConfig:
    """When rollouts are sampled relative to training, and on which weights."""

    synchronous: bool = False
    """Sample a step's groups, then train, then sync: no overlap (the on-policy baseline)."""
    max_lag: int = 0
    """O: a sample may be trained at most O weight-sync versions after it was sampled (0: on-policy)."""
    weight_sync_interval: int = 1
    """Push the policy into the sampler every N steps (1: on-policy; 0: never, the sampler keeps the base weights)."""
    partial_rollouts: bool = False
    """In-flight weight updates (asynchronous training): every generated token is tagged with the
    version of the weights that produced it, and a group counts at its oldest token's version. With
    `sampler.kind=vllm_server` a weight sync interrupts the completions being generated and each
    goes on after it on the new weights; with `hf` a sync waits for the running generate call, so a
    completion has one version, and a multi-turn rollout's turns each their own."""
    max_rollout_versions: int = 0
    """With partial rollouts: the most weight versions one trajectory may span (a group with one
    that spans more is sampled again); 0: no bound but the off-policy gate's."""

    def __post_init__(self) -> None:
        require(self.max_lag >= 0, "offpolicy.max_lag", "must be >= 0 (0: on-policy)")
        require(self.weight_sync_interval >= 0, "offpolicy.weight_sync_interval", "must be >= 0 (0: never sync)")
        require(self.max_rollout_versions >= 0, "offpolicy.max_rollout_versions", "must be >= 0 (0: no bound)")
        require(
            not (self.partial_rollouts and self.synchronous),
            "offpolicy.partial_rollouts",
            "needs offpolicy.synchronous=false: a synchronous step has no rollout in flight at a weight sync",
        )
        require(
            not self.partial_rollouts or self.weight_sync_interval > 0,
            "offpolicy.partial_rollouts",
            "needs weight syncs (offpolicy.weight_sync_interval > 0)",
        )
        require(
            self.synchronous or self.weight_sync_interval <= self.max_lag + 1,
            "offpolicy.weight_sync_interval",
            f"must be <= offpolicy.max_lag + 1 = {self.max_lag + 1} with the off-policy scheduler "
            "(offpolicy.synchronous=false): the gate admits rows at most that many versions ahead, so a "
            "longer sync window would wait forever for rollouts",
        )
