"""`GroupSampler`: the G rollout calls of one row, their checks, and whether the group trains.

It is the one stateful piece the two schedulers share (by composition): the circuit breaker over
the user's rollout function, the drop counts since the last step, and one warning per new kind
of problem. The decisions themselves are the pure functions of `lit_grpo.rollouts.pipeline`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter

from lit_grpo.rollout import RolloutFn
from lit_grpo.rollouts.checks import CircuitBreaker
from lit_grpo.rollouts.pipeline import GroupFilter, checked_samples, group_verdict
from lit_grpo.types import PromptGroup

log = logging.getLogger(__name__)


def row_label(row: dict) -> str:
    """A short name of a row for log lines."""
    for key in ("id", "prompt", "question"):
        if key in row:
            return f"{key}={str(row[key])[:60]!r}"
    return "<row>"


class GroupSampler:
    """Samples the `completions_per_prompt` trajectories of a row and judges the group."""

    def __init__(self, rollout_fn: RolloutFn, completions_per_prompt: int, *, max_seq_len: int, min_group_size: int,
                 filters: list[GroupFilter]) -> None:
        self.rollout_fn, self.G = rollout_fn, completions_per_prompt
        self.max_seq_len, self.min_group_size = max_seq_len, min_group_size
        self.filters = filters
        """Group predicates, all of which must keep a group (the uniform-reward filter registers here)."""
        self.breaker = CircuitBreaker()
        self._counts: Counter = Counter()
        self._lock = threading.Lock()  # the off-policy scheduler counts on its own thread
        self._warned: set[str] = set()

    async def sample(self, row: dict, version: int) -> PromptGroup:
        """The row's group, sampled at policy `version`; raises when the circuit breaker trips."""
        results = await asyncio.gather(*(self.rollout_fn(row) for _ in range(self.G)), return_exceptions=True)
        for result in results:
            failed = isinstance(result, BaseException)
            self.breaker.record(failed, result if failed else None)
        samples, counts, error = checked_samples(results, self.max_seq_len)
        self._add(counts)
        for key in counts:
            if key not in self._warned:
                self._warned.add(key)
                detail = f": {error!r}" if key == "rollout/failures" else ""
                log.warning("row %s: a rollout sample was dropped (%s, counted in that metric)%s", row_label(row), key, detail)
        return PromptGroup(row=row, samples=samples, version=version)

    def accept(self, group: PromptGroup) -> bool:
        """Whether the group trains; a rejection is counted under its reason."""
        verdict = group_verdict(group, self.min_group_size, self.filters)
        if verdict is not None:
            self._add(Counter({verdict: 1}))
        return verdict is None

    def take_counts(self) -> Counter:
        """The drop and failure counts since the previous call."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return counts

    def _add(self, counts: Counter) -> None:
        with self._lock:
            self._counts.update(counts)
