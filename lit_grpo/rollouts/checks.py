"""Guards between a user's rollout function and the trainer: malformed samples and failing rollouts.

A malformed `RolloutSample` is dropped with a named reason (counted as `rollout/dropped_<reason>`)
instead of corrupting a batch; a rollout function that keeps raising trips the circuit breaker,
which stops training with a clear error rather than training on whatever trickles through.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

from lit_grpo.types import RolloutSample

DROP_REASONS = ("length_mismatch", "empty_mask", "nonfinite_reward", "too_long", "not_a_sample")


def sample_problem(sample: object, max_seq_len: int) -> Optional[str]:
    """Why `sample` cannot be trained on (one of DROP_REASONS), or None when it is fine."""
    if not isinstance(sample, RolloutSample):
        return "not_a_sample"
    if not len(sample.tokens) == len(sample.logprobs) == len(sample.loss_mask):
        return "length_mismatch"
    if not any(sample.loss_mask):
        return "empty_mask"
    if not isinstance(sample.reward, (int, float)) or not math.isfinite(sample.reward):
        return "nonfinite_reward"
    if len(sample.tokens) > max_seq_len:
        return "too_long"
    return None


class RolloutCircuitOpen(RuntimeError):
    """The rollout function failed too often; training stops instead of limping on."""


class CircuitBreaker:
    """Trips after `max_consecutive` failures in a row, or when at least `max_failure_rate` of
    the last `window` calls failed (once `window` calls have been seen)."""

    def __init__(self, max_consecutive: int = 5, window: int = 20, max_failure_rate: float = 0.5) -> None:
        self.max_consecutive, self.max_failure_rate = max_consecutive, max_failure_rate
        self.recent: deque[bool] = deque(maxlen=window)
        self.consecutive = 0

    def record(self, failed: bool, error: Optional[BaseException] = None) -> None:
        """Count one rollout call; raise `RolloutCircuitOpen` when the breaker trips."""
        self.recent.append(failed)
        self.consecutive = self.consecutive + 1 if failed else 0
        rate = sum(self.recent) / len(self.recent)
        if self.consecutive >= self.max_consecutive or (len(self.recent) == self.recent.maxlen and rate >= self.max_failure_rate):
            raise RolloutCircuitOpen(
                f"rollout_fn failed {self.consecutive} times in a row and {sum(self.recent)} of the last "
                f"{len(self.recent)} calls; last error: {error!r}. Fix the rollout function (or its "
                f"environment) and resume."
            ) from error
