"""What one optimizer step reads and records besides its forward and backward passes.

`loss_settings(c)` is the one place the config is read for the loss, once per run. `StepTotals`
holds the step's loss normalizers (summed over the ranks) and adds up each micro-batch's metrics,
weighted by its share of the step's tokens. `StepUpdate.finish` decides the step with every rank
(`lit_grpo.loop.skipped_steps`), clips the gradients, and steps the optimizer and the learning-rate
schedule, or drops the gradients and leaves the weights, the optimizer's state and the schedule as
they were.

A skipped step does not advance the schedule: warm-up and decay are functions of the updates
made, as Adam's own step count (its bias correction) is. Were it advanced, a run whose first steps
carry no signal (every group's rewards equal) would make its first update past part of its
warm-up, the step warm-up exists to protect. The decay's horizon stays the planned
`max_steps × ppo_n_minibatches` steps, so a run that skipped some ends with its learning rate that
many steps short of the end of the decay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from lit_grpo.config import TrainConfig
from lit_grpo.loop.distributed import all_reduce
from lit_grpo.loop.skipped_steps import SKIP_METRICS, TAKEN, SkippedSteps, step_verdict
from lit_grpo.maths.losses import LossSettings
from lit_grpo.models.sharding import full_value


def loss_settings(c: TrainConfig) -> LossSettings:
    """What the loss reads of the config: the variant and its hyper-parameters, the normalization,
    the mismatch correction and the entropy controls (the bonus starts at `entropy.coef`; the
    module's `EntropyControl` moves it step by step)."""
    return LossSettings(
        name=c.policy_loss.name,
        hyperparams=c.policy_loss.hyperparams(),
        normalization=c.policy_loss.loss_normalization,
        correction=c.correction.name,
        correction_params=c.correction.params(),
        off_policy_delta=c.correction.off_policy_delta,
        top_entropy_quantile=c.entropy.top_quantile,
        entropy_coef=c.entropy.coef,
    )


class StepTotals:
    """One optimizer step's loss normalizers and its metrics, added up over its micro-batches.

    The normalizers count the whole step on every rank (one collective), so that W ranks' step is
    one step on the union of their rows. Each micro-batch's metrics are token means; weighted by
    its tokens over the global count they add up (over micro-batches and ranks) to the step's
    token means. They are kept as one vector: one op per micro-batch, not one per metric."""

    def __init__(self, mask_BT: torch.Tensor, computed_tokens: Optional[torch.Tensor] = None) -> None:
        """`mask_BT`: this rank's loss mask of the step's rows, [B, T]; `computed_tokens`: the masked
        tokens of the rows its forwards compute (None: every row; fewer where rows of advantage 0
        are left out), which the metrics' means are over. The loss's normalizers count every row."""
        computed = mask_BT.sum() if computed_tokens is None else computed_tokens.to(mask_BT.dtype)
        counts = torch.stack([mask_BT.sum(), torch.tensor(float(mask_BT.shape[0]), device=mask_BT.device), computed])
        num_tokens, self.num_sequences, metric_tokens = all_reduce(counts)
        self.num_tokens = num_tokens.clamp_min(1.0)
        self.metric_tokens = metric_tokens.clamp_min(1.0)
        self.loss_sum = torch.zeros((), device=mask_BT.device)
        self._keys: list[str] = []
        self._weighted_K: Optional[torch.Tensor] = None

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> None:
        """A micro-batch's loss (its share of the step's) and its token-mean metrics over `mask_BT`."""
        weight = mask_BT.sum() / self.metric_tokens
        self._keys = self._keys or [f"train/{key}" for key in metrics]
        values_K = torch.stack([value.detach().float() for value in metrics.values()]) * weight
        self._weighted_K = values_K if self._weighted_K is None else self._weighted_K + values_K
        self.loss_sum = self.loss_sum + loss.detach()

    def metrics(self) -> dict[str, torch.Tensor]:
        """`train/<metric>` of this rank's share (summed over ranks: the step's), and `train/loss`."""
        totals = dict(zip(self._keys, self._weighted_K.unbind() if self._weighted_K is not None else ()))
        totals["train/loss"] = self.loss_sum
        return totals


Clip = Callable[[list[torch.Tensor], torch.Tensor], None]
"""`clip(params_with_grads, grad_norm)`: scale the gradients to the clip norm (the module's, which
knows its precision plugin and its sharding)."""


class StepUpdate:
    """The end of an optimizer step: take its update, or skip it with every rank."""

    def __init__(self, max_nonfinite_steps: int, grad_clip_norm: float) -> None:
        self.skipped = SkippedSteps(max_nonfinite_steps)
        """Optimizer steps whose update was skipped: non-finite, or without a learning signal."""
        self.grad_clip_norm = grad_clip_norm
        self.last_taken = False
        """Whether the latest step's update was taken (the same on every rank)."""

    def finish(
        self,
        optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        totals: StepTotals,
        signal: torch.Tensor,
        clip: Clip,
        *,
        step: int,
        world_size: int,
        warn: bool,
    ) -> dict[str, torch.Tensor]:
        """The step's metrics, after its update was taken (gradients clipped, optimizer and schedule
        stepped) or skipped (gradients dropped, nothing else moves). `signal` ([] bool): whether this
        rank has a trained token with a non-zero advantage; `step`: the rollout step, for messages;
        `warn`: say the first skip for want of signal (rank 0)."""
        metrics = totals.metrics()
        # The optimizer's own list: walking the policy's modules for its parameters costs more than the norm.
        with_grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = full_value(torch.nn.utils.get_total_norm([p.grad for p in with_grads]))  # sharded: all ranks'
        metrics["train/grad_norm"] = grad_norm.detach() / world_size  # summed over ranks (equal under DDP)
        metrics["train/grad_norm_clipped"] = metrics["train/grad_norm"]  # no clipping: the norm the update used
        verdict = step_verdict(totals.loss_sum, grad_norm, signal)
        metrics.update(self.skipped.metrics(verdict, world_size, grad_norm.device))
        self.skipped.note(verdict, totals.loss_sum, grad_norm, step, warn)
        self.last_taken = verdict == TAKEN
        if verdict != TAKEN:
            optimizer.zero_grad()  # the weights, the optimizer's state and the schedule stay as they were
            return metrics
        if self.grad_clip_norm > 0:
            clip(with_grads, grad_norm)
            # The norm after clipping, by clip_grad_norm_'s own factor min(1, c / (‖g‖ + 1e-6)): no second
            # pass over the grads.
            factor = (self.grad_clip_norm / (grad_norm.detach() + 1e-6)).clamp(max=1.0)
            metrics["train/grad_norm_clipped"] = metrics["train/grad_norm"] * factor
        optimizer.step()
        scheduler.step()
        return metrics


def mean_over_minibatches(per_minibatch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A rollout step's metrics from its optimizer steps' (one per PPO minibatch): their mean, but
    the skip counts summed (how many of its optimizer steps were skipped)."""
    if len(per_minibatch) == 1:
        return per_minibatch[0]
    metrics = {key: torch.stack([m[key] for m in per_minibatch]).mean(0) for key in per_minibatch[0]}
    metrics.update({key: metrics[key] * len(per_minibatch) for key in SKIP_METRICS.values()})
    return metrics
