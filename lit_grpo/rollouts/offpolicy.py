"""The off-policy scheduler (`offpolicy.synchronous: false`): rollouts run on a background event
loop and overlap training, admitted through the off-policy gate
(docs/guides/async-training.md).

With B = P·G samples per step and O = offpolicy.max_lag, the samples of version v may be
accepted while `accepted <= budget(v) = (O + v + 1) · B`, where `accepted` counts samples of groups
that passed the filters so far. A group sampled at version v is kept only if it is among the first
budget(v) accepted samples, so it trains at most O versions after it was sampled; O = 0 is strictly
on-policy. A row (all G samples at the version of the moment) may start only while

    rate · (running + G) <= budget(version) - accepted

with `running` the samples in flight and `rate` the running fraction of groups the filters accept
(at least 1/4): rows are oversampled by 1/rate, as the synchronous scheduler does, so a filter
that rejects half the groups does not refill a step in a chain of rounds of one rollout latency
each. A group accepted past its budget (the surplus, or a straggler) is not trained: its row goes
back to the cursor and is sampled again, later (`rollout/stale_groups`).

With partial rollouts (`offpolicy.partial_rollouts: true`) a trajectory may go on across weight syncs; its
group counts at the oldest version among its tokens (`PromptGroup.version`), so it still trains at
most O versions after its first token. `offpolicy.max_rollout_versions` (K > 0) also bounds how many
versions one trajectory may span: a group with one that spans more is sampled again
(`rollout/span_groups`).

The interface, and the bounds on every wait, are those of `lit_grpo.rollouts.schedulers`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from typing import Optional

from lit_grpo.rollouts.cursor import Cursor, Position
from lit_grpo.rollouts.deadlines import Heartbeat, RolloutStalled, heartbeat_period, stall_report
from lit_grpo.rollouts.groups import GroupSampler
from lit_grpo.rollouts.schedulers import StepGroups
from lit_grpo.samplers.worker import THREAD_PREFIX, join_thread
from lit_grpo.types import PromptGroup, versions_spanned

_DONE = None  # queue sentinel: no more groups will come (rows used up, or an error)


class OffPolicyScheduler:
    """Samples on its own thread and event loop, bounded by the off-policy gate and `max_concurrency`."""

    def __init__(
        self,
        cursor: Cursor,
        groups: GroupSampler,
        prompt_groups_per_step: int,
        *,
        max_head_offpolicy_versions: int,
        max_concurrency: int,
        max_rollout_versions: int = 0,
    ) -> None:
        self.cursor, self.groups, self.P = cursor, groups, prompt_groups_per_step
        self.max_rollout_versions = max_rollout_versions
        self.G = groups.G
        self.B = self.P * self.G
        self.max_head_offpolicy_versions, self.max_concurrency = max_head_offpolicy_versions, max_concurrency
        self.version = 0
        self.trained_samples = 0
        """Samples (G per group) of the groups handed to the trainer so far."""
        self.accepted_samples = 0
        """Samples (G per group) of every group accepted so far, trained or queued."""
        self.running = 0
        """Samples in flight."""
        self.accept_rate = 1.0
        """Running fraction of sampled groups the filters accept (sizes the oversampling)."""
        self.max_oversample = 4
        self._loop = asyncio.new_event_loop()
        self._unfinished: set[Position] = set()  # rows sampling or queued, not yet trained
        self._lock = (
            threading.Lock()
        )  # the cursor, `_unfinished` and `version` change together, for a consistent snapshot
        self._ready: queue.Queue[Optional[tuple[Position, PromptGroup]]] = queue.Queue()
        self._rejected: deque[PromptGroup] = deque()
        self._error: Optional[BaseException] = None
        self._stopping = self._finished = False
        self._wake = asyncio.Event()  # bound to the sampling loop on its first wait (Python >= 3.10)
        self._thread: Optional[threading.Thread] = None
        self._gate_wait_s = 0.0
        self._last_handover: Optional[float] = None
        self.rollout_intervals: list[tuple[float, float]] = []
        """(start, end) of every group's sampling, for the overlap measurement."""
        self.heartbeat = Heartbeat(heartbeat_period(groups.timeout_s))
        self._stalled = False
        self._gate_shut_before = False

    # ---------------------------------------------------------------- sampling thread

    def budget(self, version: int) -> int:
        """Accepted samples (all steps so far) that rows sampled at `version` may bring the total to."""
        return (self.max_head_offpolicy_versions + version + 1) * self.B

    def can_admit(self) -> bool:
        """The off-policy gate and the concurrency cap, for one more row of G samples."""
        room = self.budget(self.version) - self.accepted_samples
        expected = (self.running + self.G) * max(self.accept_rate, 1 / self.max_oversample)
        return expected <= room and self.running + self.G <= self.max_concurrency

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._admit_rows())

    async def _admit_rows(self) -> None:
        beat = asyncio.create_task(self.heartbeat.run())
        try:
            await self._admit_until_done()
        except Exception as err:  # the cursor's own refusal (a curriculum with nothing to draw), or a bug:
            if self._error is None:  # the trainer raises it, not "the rows ran out" with nothing trained
                self._error = err
            self._stopping = True
        finally:
            beat.cancel()
            # What the rollouts left on the loop (a sampler's batching task) ends with it, not pending.
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=1.0)
            self._ready.put(_DONE)

    async def _admit_until_done(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self._stopping:
            if not self.can_admit():
                waited = await self._wait_for_wake()  # awaited first: `x += await` would add to a stale `x`
                with self._lock:
                    self._gate_wait_s += waited
                continue
            with self._lock:
                taken = self.cursor.take_positioned(1)
                if taken:
                    (position, row), version = taken[0], self.version
                    self._unfinished.add(position)
            if not taken:
                if self.running == 0:
                    break
                await self._wait_for_wake()  # a row in flight may yet come back to the cursor (`_sample_again_later`)
                continue
            self.running += self.G
            task = asyncio.create_task(self._run_group(position, row, version))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            if self._stopping:  # closing: nobody will train these groups, so do not wait for them
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _wait_for_wake(self) -> float:
        """Until a group ends or the version advances; returns the seconds waited."""
        waited_from = time.perf_counter()
        self._wake.clear()
        await self._wake.wait()
        return time.perf_counter() - waited_from

    async def _run_group(self, position: Position, row: dict, version: int) -> None:
        started = time.perf_counter()
        try:
            group = await self.groups.sample(row, version, self.cursor.context(position))
            keep = self.groups.accept(group)
        except asyncio.CancelledError:  # closing: the scheduler stops, and this row is not trained
            return
        except BaseException as err:  # the circuit breaker, or a user filter that raised
            if self._error is None:  # the first error is the cause; later ones (or cancellations) follow from it
                self._error = err
            self._stopping = True
            self._ready.put(_DONE)
            return
        finally:
            self.running -= self.G
            self.rollout_intervals.append((started, time.perf_counter()))
            self._wake.set()
        self.accept_rate = 0.9 * self.accept_rate + 0.1 * float(keep)
        if keep and 0 < self.max_rollout_versions < versions_spanned(group.samples):
            self._sample_again_later(position, group, "rollout/span_groups")
        elif keep and self.accepted_samples + self.G > self.budget(group.version):
            self._sample_again_later(position, group)
        elif keep:
            self.accepted_samples += self.G
            self._ready.put((position, group))
        else:
            with self._lock:
                self._unfinished.discard(position)  # a rejected row is used up, like a trained one
            self._rejected.append(group)

    def _sample_again_later(self, position: Position, group: PromptGroup, why: str = "rollout/stale_groups") -> None:
        """An accepted group past its version's budget would train > O versions late (or one of its
        trajectories spans more than `offpolicy.max_rollout_versions`): resample its row."""
        with self._lock:
            self._unfinished.discard(position)
            self.cursor.sample_again(position)
        self.groups.count(why)
        self._rejected.append(group)  # sampled, not trained: still in the step's reward metrics

    # ---------------------------------------------------------------- trainer thread

    def _start(self) -> None:
        if self._thread is None:
            self.heartbeat.reset()
            self._thread = threading.Thread(target=self._run, name=THREAD_PREFIX + "rollout-scheduler", daemon=True)
            self._thread.start()

    def advance_version(self) -> None:
        # Counted at once (a checkpoint taken right after must see it), then the loop re-checks its gate.
        with self._lock:
            self.version += 1
        self._start()
        self._loop.call_soon_threadsafe(self._wake.set)

    def next_groups(self) -> StepGroups:
        """Wait for P accepted groups (or the end of the rows)."""
        self._start()
        waited_from = time.perf_counter()
        accepted: list[PromptGroup] = []
        while len(accepted) < self.P and not self._finished:
            try:
                item = self._ready.get(timeout=self.heartbeat.period_s)
            except queue.Empty:
                self._check_loop()
                continue
            if item is _DONE:
                self._finished = True
                if self._error is not None:
                    raise self._error
                break
            position, group = item
            with self._lock:
                self._unfinished.discard(position)
            accepted.append(group)
        self.trained_samples += self.G * len(accepted)
        now = time.perf_counter()
        train_window = (self._last_handover or waited_from, waited_from)  # the previous step trained here
        self._last_handover = now
        rejected = [self._rejected.popleft() for _ in range(len(self._rejected))]
        with self._lock:
            gate_wait_s, self._gate_wait_s = self._gate_wait_s, 0.0
        timings = {
            "perf/sample_s": now - train_window[0],
            "perf/trainer_wait_s": now - waited_from,
            "perf/sampler_wait_s": gate_wait_s,
            "perf/overlap_ratio": self._overlap(*train_window),
            "async/in_flight": float(self.running),
        }
        return StepGroups(accepted, accepted + rejected, timings)

    def _check_loop(self) -> None:
        """While the trainer waits: the sampling loop must be alive and running."""
        thread, stale = self._thread, self.heartbeat.stale_for()
        assert thread is not None, "checked only once the sampling thread has started"
        if stale > self.groups.timeout_s:
            self._stalled = True
            raise RolloutStalled(stall_report(stale, self.groups.timeout_s, thread.ident, self.groups.rollout_fn))
        if not thread.is_alive() and self._ready.empty():
            self._finished = True
            raise RuntimeError("the rollout thread ended without handing over its groups or an error")
        # Nothing in flight and the gate shut while the trainer waits: only a version advance (which
        # needs this step) could open it. Seen twice in a row, a slice apart, so a group between its
        # end and its hand-over does not count.
        gate_shut = self.running == 0 and not self.can_admit() and self._ready.empty()
        if gate_shut and self._gate_shut_before:
            raise RuntimeError(
                f"the off-policy gate admits no row while the trainer waits for groups (version {self.version}, "
                f"{self.accepted_samples} samples accepted, {self.trained_samples} trained, B={self.B}): check "
                "offpolicy.weight_sync_interval <= offpolicy.max_lag + 1"
            )
        self._gate_shut_before = gate_shut

    def state_dict(self) -> dict:
        """Version, gate counter and data position between two steps. Rows sampling or queued
        (not yet trained) are saved as unfinished: a resumed run samples them again first."""
        with self._lock:
            return {
                "version": self.version,
                "trained_samples": self.trained_samples,
                "accept_rate": self.accept_rate,
                "cursor": self.cursor.state_dict(unfinished=sorted(self._unfinished)),
            }

    def load_state_dict(self, state: dict) -> None:
        """Before the first step: the gate resumes as if every trained sample had just been accepted."""
        if self._thread is not None:
            raise RuntimeError("load the scheduler's state before it starts sampling")
        self.version, self.trained_samples = state["version"], state["trained_samples"]
        self.accepted_samples = self.trained_samples
        self.accept_rate = state.get("accept_rate", 1.0)
        self.cursor.load_state_dict(state["cursor"])

    def _overlap(self, start: float, end: float) -> float:
        """Fraction of [start, end] (the trainer's last step) during which some rollout ran."""
        if end <= start:
            return 0.0
        intervals = sorted(
            (max(a, start), min(b, end)) for a, b in list(self.rollout_intervals) if b > start and a < end
        )
        covered, reach = 0.0, start
        for a, b in intervals:
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        self.rollout_intervals = [iv for iv in self.rollout_intervals if iv[1] > end]  # older ones are done with
        return covered / (end - start)

    def close(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
            # In-flight rollouts are cancelled; a loop blocked by a rollout never ends: leave its daemon thread.
            join_thread(self._thread, 1 if self._stalled else 10, "the rollout scheduler's event loop")
        if not self._loop.is_running():
            self._loop.close()
