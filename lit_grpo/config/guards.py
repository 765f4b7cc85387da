"""The `guards` group: the bounds that keep a run from hanging or going on broken: each rollout
call's deadline and retries, the share of failed rows, the rows without progress and the
non-finite steps a run survives. Every field is checked alone, here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lit_grpo.config.checks import exception_class, require, require_finite

NO_PROGRESS_STEPS = 10
"""`guards.max_rows_without_progress=null`: this many steps' worth of rows without one group that trains..."""
NO_PROGRESS_MIN_ROWS = 100
"""...and never fewer rows: a small step of a model that earns its first rewards rarely needs room."""
ROLLOUT_DEADLINE_BASE_S = 300.0
"""`guards.rollout_timeout_s=null`: this many seconds for any rollout call..."""
ROLLOUT_DEADLINE_S_PER_TOKEN = 0.5
"""...plus this much per `sampler.max_completion_tokens`: a batch of long completions of a real model
on a CPU decodes a token for every row in a few tenths of a second (SmolLM2-135M, 64 rows: ~0.2 s)."""


@dataclass
class GuardsConfig:
    """When a rollout is retried or given up on, and when the run stops rather than go on."""

    rollout_timeout_s: Optional[float] = None
    """Deadline of each rollout call, in seconds: a call still running is cancelled and counted in
    `rollout/timeouts` (retried like any transient error, then a `rollout/failures`); the first one
    logs the sampling pace (tokens/s, rows in flight) and whether it is slow or stuck. It also
    bounds each batched sampler call, and how long the rollout event loop may go without running: a
    rollout that blocks it (`time.sleep` in an async rollout) stops the run with `RolloutStalled`.
    null: `ROLLOUT_DEADLINE_BASE_S` (300 s) plus `ROLLOUT_DEADLINE_S_PER_TOKEN` (0.5 s) per
    `sampler.max_completion_tokens`."""
    rollout_max_retries: int = 2
    """Retries of a rollout call that ended in a transient error (`rollout_retry_on`), with backoff
    0.5 s, 1 s, 2 s, ...; counted in `rollout/retries`. A bug in the rollout (`TypeError`,
    `KeyError`, ...) is never retried: it stops the run at once."""
    rollout_retry_on: list[str] = field(default_factory=lambda: ["TimeoutError", "ConnectionError", "OSError"])
    """The exceptions (builtin names, or `module.Class` paths) of a rollout call that are retried;
    any other (not a bug) drops the call's sample, counted in `rollout/failures`."""
    rollout_failure_share: float = 0.5
    """The run stops when at least this share of the last `rollout_failure_window` rows failed (a
    row fails when every rollout call of it raised), or 5 rows in a row did; below that a failed
    row only drops its group (`rollout/failures`)."""
    rollout_failure_window: int = 20
    """The rows `rollout_failure_share` is taken over."""
    max_rows_without_progress: Optional[int] = None
    """Consecutive rows sampled without one accepted group before the run stops with
    `NoProgressError` (exit 2), whose message counts the rows per drop reason (None returned,
    malformed samples, non-finite rewards, uniform groups filtered, prompts too long, failures).
    null: `NO_PROGRESS_STEPS` (10) steps' worth of rows, `data.prompt_groups_per_step` x 10 and at
    least 100, the analogue of verl's `max_num_gen_batches`."""
    max_nonfinite_steps: int = 3
    """Consecutive training steps whose loss or gradient norm is non-finite before the run stops;
    each such step's update is skipped."""

    peer_heartbeat_s: float = 2.0
    """With several ranks, each adds to a counter of its own in the rendezvous store this often and
    reads the others' (`lit_grpo/loop/peers.py`)."""
    peer_timeout_s: float = 30.0
    """A rank whose counter has not moved for this long (killed, its node down, its link cut), or a
    rendezvous store that has not answered for this long, stops every other rank with one message
    naming it, instead of a wait in a collective until `collective_timeout_s`. Worst-case detection:
    `peer_timeout_s + peer_heartbeat_s`; a rank that fails with an error is seen at the others' next
    heartbeat. 0 turns the watch off (a debugger paused on one rank would otherwise stop the run)."""
    collective_timeout_s: float = 1800.0
    """The process group's timeout (DDP and FSDP2): a collective that has not completed by then
    fails. The backstop behind `peer_timeout_s`; it must exceed the longest wait of a rank for the
    others in a healthy run (one rank's sampling while the others wait at the step's all-reduce)."""

    def rollout_deadline_s(self, max_completion_tokens: int) -> float:
        """`rollout_timeout_s`, its null read as following the completions' length."""
        if self.rollout_timeout_s is not None:
            return self.rollout_timeout_s
        return ROLLOUT_DEADLINE_BASE_S + ROLLOUT_DEADLINE_S_PER_TOKEN * max_completion_tokens

    def rows_without_progress(self, prompt_groups_per_step: int) -> int:
        """`max_rows_without_progress`, its null read as `NO_PROGRESS_STEPS` steps' worth of rows."""
        if self.max_rows_without_progress is not None:
            return self.max_rows_without_progress
        return max(NO_PROGRESS_STEPS * prompt_groups_per_step, NO_PROGRESS_MIN_ROWS)

    def __post_init__(self) -> None:
        if self.rollout_timeout_s is not None:
            require_finite(self.rollout_timeout_s, "guards.rollout_timeout_s")
            require(
                self.rollout_timeout_s > 0,
                "guards.rollout_timeout_s",
                f"must be null (following sampler.max_completion_tokens) or > 0 seconds, got {self.rollout_timeout_s}",
            )
        require(
            0 <= self.rollout_max_retries <= 10,
            "guards.rollout_max_retries",
            f"must be in [0, 10], got {self.rollout_max_retries}",
        )
        for name in self.rollout_retry_on:
            require(
                exception_class(name) is not None,
                "guards.rollout_retry_on",
                f"{name!r} is not an exception class (a builtin name such as ConnectionError, or module.Class)",
            )
        require_finite(self.rollout_failure_share, "guards.rollout_failure_share")
        require(0 < self.rollout_failure_share <= 1, "guards.rollout_failure_share", "must be in (0, 1]")
        require(self.rollout_failure_window >= 1, "guards.rollout_failure_window", "must be >= 1")
        require(
            self.max_rows_without_progress is None or self.max_rows_without_progress >= 1,
            "guards.max_rows_without_progress",
            "must be null (10 steps' worth of rows) or >= 1",
        )
        require(self.max_nonfinite_steps >= 1, "guards.max_nonfinite_steps", "must be >= 1")
        for name in ("peer_heartbeat_s", "peer_timeout_s", "collective_timeout_s"):
            require_finite(getattr(self, name), f"guards.{name}")
        require(
            self.peer_heartbeat_s > 0, "guards.peer_heartbeat_s", f"must be > 0 seconds, got {self.peer_heartbeat_s}"
        )
        require(
            self.peer_timeout_s == 0 or self.peer_timeout_s >= 3 * self.peer_heartbeat_s,
            "guards.peer_timeout_s",
            f"must be 0 (off) or at least 3 heartbeats (guards.peer_heartbeat_s={self.peer_heartbeat_s}), "
            f"got {self.peer_timeout_s}",
        )
        require(
            self.collective_timeout_s > self.peer_timeout_s,
            "guards.collective_timeout_s",
            f"must exceed guards.peer_timeout_s ({self.peer_timeout_s}), got {self.collective_timeout_s}",
        )
