"""The cookbook's evaluation hook: `evaluation_fn(step, eval_rollout_fn) -> dict | None`, awaited
every `interval` steps and after the last, its numbers logged with the step's metrics.

`eval_rollout_fn` is the run's own rollout function called with `evaluation=True` (for rollout
functions that declare it), so an evaluation samples from the sampler holding the policy just
synced. It runs on rank 0 only (the others go on to the next step's collectives and wait there),
on an event loop of its own, under a deadline: an evaluation past it is cancelled with a warning
and training goes on. A bug in it (any other exception) stops the run, as a rollout bug does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Awaitable, Callable, Mapping, Optional

from lit_grpo.rollouts.context import make_evaluation_rollout_fn

log = logging.getLogger(__name__)


class RolloutEvaluator:
    """Awaits the user's `evaluation_fn` when due and turns its result into metrics."""

    def __init__(self, evaluation_fn: Callable[[int, Callable[..., Awaitable[Any]]], Awaitable[Optional[dict]]],
                 rollout_fn: Callable[..., Awaitable[Any]], *, interval: int = 1, timeout_s: float = 3600.0) -> None:
        if interval < 1:
            raise ValueError(f"evaluation_interval must be >= 1, got {interval}")
        self.evaluation_fn, self.interval, self.timeout_s = evaluation_fn, interval, timeout_s
        self.eval_rollout_fn = make_evaluation_rollout_fn(rollout_fn)
        self.last_step: Optional[int] = None

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and step != self.last_step

    def evaluate(self, step: int, rank: int = 0) -> dict[str, float]:
        """The metrics of `evaluation_fn(step, eval_rollout_fn)` (rank 0; other ranks get none)."""
        self.last_step = step
        if rank != 0:
            return {}
        start = time.perf_counter()
        try:
            result = asyncio.run(asyncio.wait_for(self.evaluation_fn(step, self.eval_rollout_fn), self.timeout_s))
        except TimeoutError:
            log.warning("step %d: evaluation_fn did not return within %g s; it was cancelled and training goes on", step, self.timeout_s)
            return {"eval/timeouts": 1.0}
        if result is not None and not isinstance(result, Mapping):
            raise TypeError(f"evaluation_fn returned a {type(result).__name__}; it must return a dict of metrics or None")
        metrics = {"eval/wall_time": time.perf_counter() - start}
        for key, value in (result or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                metrics[str(key)] = float(value)
            else:
                log.warning("step %d: evaluation_fn returned %s=%r, not a finite number; not logged", step, key, value)
        return metrics
