"""Optimizer steps that are not taken, decided by every rank together.

An optimizer step's update is skipped, its gradients dropped and the weights and the optimizer's
state left as they were, when

- its loss or gradient norm is non-finite on any rank (`train/skipped_nonfinite`; after
  `guards.max_nonfinite_steps` of them in a row the run stops: `NonFiniteTraining`);
- no rank has a trained token with a non-zero advantage (`train/skipped_no_signal`,
  `lit_grpo.maths.health.learning_signal`): the policy term has no gradient, and the KL and
  entropy terms alone are float noise (3e-8 at the first step) that Adam, dividing by the root of
  its second moment, turns into a near full learning-rate step. The uniform-reward filter drops
  such groups before they are batched; without it, this skip does the same for a whole step.

One collective decides both (`step_verdict`), so every rank skips or steps together: DDP's ranks
keep equal weights and FSDP2's shards stay one model. The learning-rate schedule stays where it
was too: it counts the updates made (`lit_grpo.loop.optimizer_step` says why).
"""

from __future__ import annotations

import logging

import torch

from lit_grpo.loop.distributed import all_reduce
from lit_grpo.loop.step_sequence import NonFiniteTraining

log = logging.getLogger(__name__)

TAKEN, NONFINITE, NO_SIGNAL = "taken", "nonfinite", "no_signal"
"""The verdicts of an optimizer step."""
SKIP_METRICS = {NONFINITE: "train/skipped_nonfinite", NO_SIGNAL: "train/skipped_no_signal"}
"""Each skip's count: optimizer steps of the rollout step skipped for it (summed over the PPO minibatches)."""


def step_verdict(loss: torch.Tensor, grad_norm: torch.Tensor, signal: torch.Tensor) -> str:
    """`NONFINITE` when the loss or the gradient norm is non-finite on any rank, else `NO_SIGNAL`
    when no rank's `signal` is true, else `TAKEN`; the same on every rank (one collective).
    Shapes: loss, grad_norm, signal (bool) [] each."""
    flags = torch.stack([(~torch.isfinite(loss.detach()) | ~torch.isfinite(grad_norm)).float(), signal.float()])
    nonfinite, any_signal = all_reduce(flags.to(grad_norm.device), "max").tolist()
    return NONFINITE if nonfinite else TAKEN if any_signal else NO_SIGNAL


class SkippedSteps:
    """What the skips of a run do beyond the step: stop after `guards.max_nonfinite_steps` non-finite
    ones in a row, and say the first skip for want of signal once."""

    def __init__(self, max_nonfinite_steps: int) -> None:
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        """Optimizer steps in a row whose loss or gradient norm was non-finite (their updates were skipped)."""
        self.said_no_signal = False

    def note(self, verdict: str, loss: torch.Tensor, grad_norm: torch.Tensor, step: int, warn: bool) -> None:
        """Count `verdict` for rollout step `step`; raise `NonFiniteTraining` past the limit, log the
        first skip for want of signal (where `warn`: rank 0)."""
        if verdict != NONFINITE:
            self.nonfinite_in_a_row = 0
        if verdict == NO_SIGNAL and not self.said_no_signal:
            self.said_no_signal = True
            if warn:
                log.warning(
                    "step %d: no trained token carries a non-zero advantage on any rank (e.g. every group's "
                    "rewards are equal), so the optimizer step is skipped: the weights and the optimizer's state "
                    "stay as they were (counted in train/skipped_no_signal; said once)",
                    step,
                )
        if verdict != NONFINITE:
            return
        self.nonfinite_in_a_row += 1
        if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
            raise NonFiniteTraining(
                f"the loss ({float(loss):.4g}) or the gradient norm ({float(grad_norm):.4g}) was non-finite in "
                f"{self.nonfinite_in_a_row} optimizer steps in a row "
                f"(guards.max_nonfinite_steps={self.max_nonfinite_steps}); "
                "each update was skipped, so the weights are those before them. Check learning_rate, the rewards and "
                "the sampler's logprobs (a rollout that reports positive or NaN logprobs poisons the importance "
                "weights)."
            )

    @staticmethod
    def metrics(verdict: str, world_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's share of each skip count (1 / world_size for the verdict's: summed over ranks, 1)."""
        return {
            key: torch.tensor(float(verdict == reason) / world_size, device=device)
            for reason, key in SKIP_METRICS.items()
        }
