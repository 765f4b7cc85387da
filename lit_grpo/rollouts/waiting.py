"""While the trainer waits for a step's groups: one line every `WAIT_REPORT_S` saying what it waits on.

A run whose rollouts are slow (a judge, a sandbox, an agent's long episodes) is not a frozen run,
and it should not look like one: `WaitReport` logs, from a daemon thread, the rows sampled and the
groups accepted since the step began, the drops by reason, and the rollout calls in flight with
the age of the oldest. Nothing is logged for a step that takes less than the period.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from lit_grpo.samplers.worker import THREAD_PREFIX, join_thread

log = logging.getLogger(__name__)

WAIT_REPORT_S = 60.0
"""Seconds between two lines while a step's groups are awaited."""


class WaitReport:
    """Context manager around the wait for step `step`'s groups from `groups` (a `GroupSampler`)."""

    def __init__(self, groups: Any, step: int, period_s: float | None = None) -> None:
        self.groups, self.step = groups, step
        self.period_s = WAIT_REPORT_S if period_s is None else period_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WaitReport:
        self._start = time.monotonic()
        self._rows_at_start = self.groups.rows_sampled
        self._thread = threading.Thread(target=self._report, name=THREAD_PREFIX + "wait-report", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        join_thread(self._thread, 5.0, "the wait report")

    def _report(self) -> None:
        while not self._done.wait(self.period_s):
            log.info("%s", self.line())

    def line(self) -> str:
        """What the step waits on, now."""
        waited = time.monotonic() - self._start
        rows = self.groups.rows_sampled - self._rows_at_start
        dropped = self.groups.peek_counts()
        in_flight = self.groups.calls_in_flight()
        drops = ", ".join(f"{key.removeprefix('rollout/')} {n}" for key, n in sorted(dropped.items()) if n) or "none"
        oldest = f", the oldest for {max(in_flight):.0f} s" if in_flight else ""
        return (
            f"step {self.step}: waiting {waited:.0f} s for its groups: {rows} rows sampled since it began; "
            f"dropped: {drops}; rows sampling now: {len(in_flight)}{oldest}"
        )
