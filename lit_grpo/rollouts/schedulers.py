"""The scheduler interface and synchronous training: when rows are sampled relative to training.
One small interface (`Scheduler`); both schedulers compose the same `RowCursor` and `GroupSampler`.

- `SynchronousScheduler` (here; `offpolicy.synchronous: true`): a step's groups are sampled on the
  trainer's thread, then the step trains, then the weights sync; nothing overlaps.
- `OffPolicyScheduler` (`lit_grpo.rollouts.offpolicy`; `offpolicy.synchronous: false`): rollouts
  run on a background event loop and overlap training, admitted through the off-policy gate.

The policy `version` of both is advanced by the step sequence (`lit_grpo.loop.step_sequence`) after each
weight sync, never by a callback.

Neither waits without a bound: each rollout call has its deadline (`GroupSampler`), rows that never
give an accepted group stop the run (`NoProgressError`), and a rollout that blocks the event loop
itself is caught by the loop's heartbeat (`RolloutStalled`): on the trainer's thread by a watchdog
that interrupts it, on the background thread by the trainer, which waits for groups in slices.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from lit_grpo.rollouts.cursor import Cursor, Position
from lit_grpo.rollouts.deadlines import Heartbeat, LoopWatchdog, gather_or_cancel, heartbeat_period, stall_report
from lit_grpo.rollouts.groups import GroupSampler
from lit_grpo.types import PromptGroup


@dataclass
class StepGroups:
    """What a scheduler hands over for one step."""

    accepted: list[PromptGroup]
    """The groups to train on (at most P; fewer, or none, only when the rows run out)."""
    sampled: list[PromptGroup]
    """Every group sampled since the previous step, rejected ones included (for reward metrics)."""
    timings: dict[str, float] = field(default_factory=dict)
    """`perf/*` (and `async/in_flight`) values of this step's sampling."""


class Scheduler(Protocol):
    """When rows are sampled; `version` counts the weight syncs the sampler has received."""

    version: int

    def next_groups(self) -> StepGroups: ...

    def advance_version(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class SynchronousScheduler:
    """Samples a step's groups concurrently on the trainer's thread until P pass every check."""

    def __init__(
        self, cursor: Cursor, groups: GroupSampler, prompt_groups_per_step: int, *, max_concurrency: int
    ) -> None:
        self.cursor, self.groups, self.P = cursor, groups, prompt_groups_per_step
        self.max_rows_in_flight = max(max_concurrency // groups.G, 1)
        self.version = 0
        self.trained_samples = 0
        self.accept_rate = 1.0
        """Running fraction of sampled groups that are accepted (sizes the refill rounds)."""
        self.max_oversample = 4
        self._loop = asyncio.new_event_loop()  # one loop for the whole run: no per-step set-up
        self.heartbeat = Heartbeat(heartbeat_period(groups.timeout_s))
        self.watchdog = LoopWatchdog(
            self.heartbeat,
            groups.timeout_s,
            lambda stale, thread_id: stall_report(stale, groups.timeout_s, thread_id, groups.rollout_fn),
        )

    def _rows_to_request(self, missing: int) -> int:
        """Rows to sample for `missing` groups: more when many are rejected, so a step needs few
        rounds (each is a batched generate call). Accepted groups beyond P are discarded rather
        than trained on later at a stale version."""
        wanted = min(math.ceil(missing / max(self.accept_rate, 0.05)), self.P * self.max_oversample)
        return min(wanted, self.max_rows_in_flight)

    async def _sample_rows(self, rows: list[tuple[Position, dict]]) -> list[PromptGroup]:
        try:
            return await gather_or_cancel(
                *(self.groups.sample(r, self.version, self.cursor.context(p)) for p, r in rows)
            )
        finally:
            await asyncio.sleep(0)  # let cancelled rollouts (timed out) finish now, not at the next step

    def _run(self, awaitable):
        """Run `awaitable` on the loop, on this thread, with the heartbeat beating and the watchdog armed."""

        async def beating():
            beat = asyncio.ensure_future(self.heartbeat.run())
            try:
                return await awaitable
            finally:
                beat.cancel()

        with self.watchdog.watching():
            return self._loop.run_until_complete(beating())

    def next_groups(self) -> StepGroups:
        start = time.perf_counter()
        accepted: list[PromptGroup] = []
        sampled: list[PromptGroup] = []
        while len(accepted) < self.P:
            rows = self.cursor.take_positioned(self._rows_to_request(self.P - len(accepted)))
            if not rows:
                break
            for group in self._run(self._sample_rows(rows)):
                sampled.append(group)
                keep = self.groups.accept(group)
                self.accept_rate = 0.9 * self.accept_rate + 0.1 * float(keep)
                if keep and len(accepted) < self.P:
                    accepted.append(group)
        self.trained_samples += self.groups.G * len(accepted)
        seconds = time.perf_counter() - start
        # The trainer waits for all of the sampling, and nothing overlaps.
        return StepGroups(
            accepted, sampled, {"perf/sample_s": seconds, "perf/trainer_wait_s": seconds, "perf/overlap_ratio": 0.0}
        )

    def advance_version(self) -> None:
        self.version += 1

    def state_dict(self) -> dict:
        return {
            "version": self.version,
            "trained_samples": self.trained_samples,
            "accept_rate": self.accept_rate,
            "cursor": self.cursor.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.version, self.trained_samples = state["version"], state["trained_samples"]
        self.accept_rate = state.get("accept_rate", 1.0)
        self.cursor.load_state_dict(state["cursor"])

    def close(self) -> None:
        """Cancel what a stopped step left on the loop (bounded: a cancelled rollout gets 1 s), then close it."""
        pending = asyncio.all_tasks(self._loop)
        if pending and not self._loop.is_closed():
            for task in pending:
                task.cancel()
            deadline = time.monotonic() + 1.0
            while True:
                try:
                    self._run(asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0.0)))
                    break
                except KeyboardInterrupt as stop:
                    # A stop signal handled inside a rollout task failed that task with the stop
                    # (lit_grpo.loop.signals.StopRequested); each task awaiting it raises it again as
                    # it ends, here. That stop is already being handled: raised from here it would
                    # skip the run's summary. Each raise ends one task, so this loop ends.
                    if not any(t.done() and not t.cancelled() and t.exception() is stop for t in pending):
                        raise
            for task in pending:  # their outcome was the stopped step's, already reported
                if task.done() and not task.cancelled():
                    task.exception()
        self.watchdog.close()
        self._loop.close()
