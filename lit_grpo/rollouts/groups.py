"""`GroupSampler`: the G rollout calls of one row, their checks, and whether the group trains.

It is the one stateful piece the two schedulers share (by composition): the deadline, retries
and circuit breaker over the user's rollout function, the drop counts since the last step, the
no-progress guard, and one warning per new kind of problem. The decisions themselves are the pure
functions of `lit_grpo.rollouts.pipeline`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Optional

from lit_grpo.rollouts.checks import CircuitBreaker, ProgressGuard, UniformGroupWatch, short_reason
from lit_grpo.rollouts.context import RolloutCalls
from lit_grpo.rollouts.deadlines import TRANSIENT_ERRORS, call_rollout, function_name, gather_or_cancel
from lit_grpo.rollouts.pipeline import GroupFilter, checked_samples, error_key, group_verdict, penalize_overlong
from lit_grpo.rollouts.rollout import RolloutFn, group_rollout_fn
from lit_grpo.tasks.rows import row_label
from lit_grpo.types import PromptGroup, oldest_token_version, versions_spanned

log = logging.getLogger(__name__)


class GroupSampler:
    """Samples the `completions_per_prompt` trajectories of a row and judges the group.

    Each rollout call is bounded by `guards.rollout_timeout_s` and transient errors are retried up to
    `max_retries` times (`lit_grpo.rollouts.deadlines.call_rollout`); a row whose prompt
    (`prompt_token_ids`) leaves no room for a completion within `max_seq_len` is never sampled;
    token ids are checked against `[0, vocab_size)` when it is given; `guards.max_rows_without_progress`
    rows in a row without an accepted group raise `NoProgressError`. With `overlong_buffer_len` > 0,
    each kept run's reward gets DAPO's overlong penalty against `max_completion_tokens`
    (`lit_grpo.rollouts.pipeline.penalize_overlong`): here, because every training rollout (the
    default one, a user's `rollout_fn` or `sample_group`) passes here before the group's filters,
    statistics and advantages see its rewards.
    """

    def __init__(
        self,
        rollout_fn: RolloutFn,
        completions_per_prompt: int,
        *,
        max_seq_len: int,
        min_group_size: int,
        filters: list[GroupFilter],
        vocab_size: Optional[int] = None,
        rollout_timeout_s: float = 300.0,
        max_retries: int = 2,
        max_rows_without_progress: int = 1000,
        max_completion_tokens: int = 0,
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        retry_on: tuple[type[BaseException], ...] = TRANSIENT_ERRORS,
        failure_share: float = 0.5,
        failure_window: int = 20,
    ) -> None:
        self.rollout_fn, self.G = rollout_fn, completions_per_prompt
        self.calls = RolloutCalls(rollout_fn)
        self.group_fn = group_rollout_fn(rollout_fn)
        """The rollout's `sample_group(row, n)` (one call per row), or None: G calls of `rollout_fn`."""
        if self.group_fn is not None:
            self._group_call = functools.update_wrapper(
                functools.partial(self.group_fn, n=completions_per_prompt), self.group_fn
            )  # error messages name the function
        self.source = function_name(self.group_fn or rollout_fn)
        """The rollout function, named with its file and line, in the warning about a result of the wrong type."""
        self.max_seq_len, self.min_group_size, self.vocab_size = max_seq_len, min_group_size, vocab_size
        self.timeout_s, self.max_retries = rollout_timeout_s, max_retries
        self.filters = filters
        self.max_completion_tokens = max_completion_tokens
        self.overlong_buffer_len, self.overlong_penalty_factor = overlong_buffer_len, overlong_penalty_factor
        """Group predicates, all of which must keep a group (the uniform-reward filter registers here)."""
        self.retry_on = retry_on
        self.breaker = CircuitBreaker(window=failure_window, max_failure_rate=failure_share)
        self.guard = ProgressGuard(max_rows_without_progress, max_seq_len=max_seq_len)
        self.uniform_watch = UniformGroupWatch(
            completions_per_prompt=completions_per_prompt, stop_after_rows=max_rows_without_progress
        )
        self.rows_sampled = 0
        self._in_flight: dict[int, float] = {}  # rows sampling now -> when they began
        self._counts: Counter = Counter()
        self._lock = threading.Lock()  # the off-policy scheduler counts on its own thread
        self._warned: set[str] = set()
        self.on_group: Optional[Callable[[PromptGroup, Optional[dict]], None]] = None
        """Called with each completed group and its row's context, before any filter sees it (the
        curriculum's statistics)."""

    async def sample(self, row: dict, version: int, context: Optional[dict] = None) -> PromptGroup:
        """The row's group, sampled at policy `version`. `context` (the row's place: `epoch`,
        `row_index`, ...) reaches the rollout functions that declare those keywords, with
        `rollout_idx`/`sample_index` (0..G-1) and `evaluation=False`. Raises when the circuit
        breaker trips, and a rollout's bug (`lit_grpo.rollouts.deadlines.BUG_ERRORS`) as it was raised."""
        self.rows_sampled += 1
        token = object()
        self._in_flight[id(token)] = time.monotonic()
        try:
            group = await self._sample(row, version, context)
            if self.on_group is not None:
                self.on_group(group, context)
            return group
        finally:
            self._in_flight.pop(id(token), None)

    def calls_in_flight(self) -> list[float]:
        """How long (seconds) each row now sampling has been at it."""
        now = time.monotonic()
        return [now - start for start in list(self._in_flight.values())]

    def peek_counts(self) -> Counter:
        """The drop and failure counts since the last `take_counts`, left in place."""
        with self._lock:
            return Counter(self._counts)

    async def _sample(self, row: dict, version: int, context: Optional[dict]) -> PromptGroup:
        prompt = row.get("prompt_token_ids")
        if prompt is not None and len(prompt) >= self.max_seq_len:  # no room left for one generated token
            counts = Counter({"rollout/dropped_prompt_too_long": self.G})
            self._note(
                row,
                counts,
                {
                    "rollout/dropped_prompt_too_long": (
                        f"a prompt of {len(prompt)} tokens, data.max_seq_len={self.max_seq_len}"
                    )
                },
            )
            return PromptGroup(row=row, samples=[], version=version, dropped=counts)
        results = await (
            self._call_group(row)
            if self.group_fn is not None
            else gather_or_cancel(
                *(
                    call_rollout(
                        self.calls.bound(i, context),
                        row,
                        timeout_s=self.timeout_s,
                        max_retries=self.max_retries,
                        count=self._count_event,
                        retry_on=self.retry_on,
                    )
                    for i in range(self.G)
                )
            )
        )
        samples, run_sizes, counts, details = checked_samples(results, self.max_seq_len, self.vocab_size, self.source)
        if self.overlong_buffer_len > 0:
            samples = penalize_overlong(
                samples, run_sizes, self.max_completion_tokens, self.overlong_buffer_len, self.overlong_penalty_factor
            )
        self._note(row, counts, details)
        # One count per row: a row fails when every call of it raised; a sample's error alone drops only it.
        errors = [r for r in results if isinstance(r, BaseException) and error_key(r) == "rollout/failures"]
        self.breaker.record(bool(results) and len(errors) == len(results), errors[-1] if errors else None)
        # With partial rollouts a sample's tokens span weight syncs: the group counts at its oldest
        # token. None can be older than the row's submission: a lower number is another count's.
        oldest = oldest_token_version(samples)
        version = version if oldest is None else max(version, oldest)
        for sample in samples:
            if sample.token_versions is not None:
                sample.metrics["async/spans_a_sync"] = float(versions_spanned([sample]) > 1)
        return PromptGroup(row=row, samples=samples, version=version, dropped=counts, run_sizes=run_sizes)

    async def _call_group(self, row: dict) -> list[object]:
        """The G results of one `sample_group(row, G)` call, under one deadline and retry budget: an
        error that ends it is every sample's result, and a retry or timeout counts G times."""

        def count_for_each(key: str, error: Optional[BaseException]) -> None:
            self._count_event(key, error, times=self.G)

        results = await call_rollout(
            self._group_call,
            row,
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            count=count_for_each,
            retry_on=self.retry_on,
        )
        if isinstance(results, BaseException):
            return [results] * self.G
        if not isinstance(results, (list, tuple)) or len(results) != self.G:
            got = f"a list of {len(results)}" if isinstance(results, (list, tuple)) else f"a {type(results).__name__}"
            raise TypeError(
                f"{function_name(self.group_fn)} returned {got} for a group of {self.G}: "
                "sample_group(row, n) returns a list of n results"
            )
        return list(results)

    def accept(self, group: PromptGroup) -> bool:
        """Whether the group trains; a rejection is counted under its reason. Raises
        `NoProgressError` when too many rows in a row were rejected."""
        if notice := self.uniform_watch.record(group.rewards if group.samples else []):
            log.warning("%s", notice)
        verdict = group_verdict(group, self.min_group_size, self.filters)
        if verdict is None:
            self.guard.accepted()
            return True
        self._add(Counter({verdict: 1}))
        self.guard.rejected(verdict, group.dropped)
        return False

    def take_counts(self) -> Counter:
        """The drop and failure counts since the previous call."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return counts

    def count(self, key: str) -> None:
        """One more of `key` in the step's drop and failure counts (summed over ranks)."""
        self._add(Counter({key: 1}))

    def _add(self, counts: Counter) -> None:
        with self._lock:
            self._counts.update(counts)

    def _count_event(self, key: str, error: Optional[BaseException], times: int = 1) -> None:
        """A retry or a timeout inside one rollout call (of `times` samples)."""
        self._add(Counter({key: times}))
        if key not in self._warned:
            self._warned.add(key)
            log.warning("a rollout call hit %s (counted in that metric)%s", key, f": {error!r}" if error else "")

    def _note(self, row: dict, counts: Counter, details: dict[str, str]) -> None:
        """Count a row's drops; warn once per kind of drop, naming the row and what was wrong."""
        self._add(counts)
        for key in counts:
            self.guard.examples.setdefault(short_reason(key), details.get(key, ""))
            if key not in self._warned:
                self._warned.add(key)
                detail = f": {details[key]}" if details.get(key) else ""
                log.warning(
                    "row %s: a rollout sample was dropped (%s, counted in that metric)%s", row_label(row), key, detail
                )
