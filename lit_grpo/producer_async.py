"""The asynchronous producer: rollouts run on a background event loop and overlap training.

Rows are admitted whole (all G samples at the policy version of the moment) through the
off-policy gate of DESIGN.md: with B = P·G samples per step and O = max_head_offpolicy_versions,
a row may start only while

    (O + version + 1) · B - (accepted + running) >= G

where `accepted` counts samples of groups that passed the filters so far and `running` those in
flight. A group admitted at version v is therefore among the first (O + v + 1)·B accepted
samples, so it is trained at most O versions after it was sampled; O = 0 is strictly on-policy.
At most `max_concurrency` samples are in flight. The trainer only waits when no accepted group
is ready.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from typing import Optional

from lit_grpo.producer import RolloutProducer
from lit_grpo.types import PromptGroup, RolloutBatch

_DONE = None  # queue sentinel: no more groups will come (rows used up, or an error)


class AsyncRolloutProducer(RolloutProducer):
    """`RolloutProducer` whose sampling runs on its own thread, bounded by the off-policy gate."""

    def __init__(self, *args, max_head_offpolicy_versions: int = 0, max_concurrency: int = 256, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_offpolicy_versions = max_head_offpolicy_versions
        self.max_concurrency = max_concurrency
        self.B = self.P * self.G
        self.accepted_samples = 0
        """Samples (G per group) of every group accepted so far, trained or queued."""
        self.running = 0
        """Samples in flight."""
        self._unfinished: set[tuple[int, int]] = set()  # row positions sampling or queued, not yet trained
        self._position_lock = threading.Lock()  # the cursor and `_unfinished` change together, for a consistent snapshot
        self._ready: queue.Queue[Optional[tuple[tuple[int, int], PromptGroup]]] = queue.Queue()
        self._rejected: deque[PromptGroup] = deque()  # filtered groups still count in reward stats
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._finished = False
        self._wake: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._gate_wait_s = 0.0
        self._last_batch_at: Optional[float] = None
        self.rollout_intervals: list[tuple[float, float]] = []
        """(start, end) of every group's sampling, for overlap measurements."""

    # ---------------------------------------------------------------- producer thread

    def can_admit(self) -> bool:
        """The off-policy gate and the concurrency cap, for one more row of G samples."""
        budget = (self.max_head_offpolicy_versions + self.version + 1) * self.B
        return budget - (self.accepted_samples + self.running) >= self.G and self.running + self.G <= self.max_concurrency

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        self._loop.run_until_complete(self._admit_rows())

    async def _admit_rows(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self._stopping:
            if not self.can_admit():
                waited_from = time.perf_counter()
                self._wake.clear()
                await self._wake.wait()
                self._gate_wait_s += time.perf_counter() - waited_from
                continue
            with self._position_lock:
                taken = self.cursor.take_positioned(1)
                if not taken:
                    break
                position, row = taken[0]
                self._unfinished.add(position)
            self.running += self.G
            task = asyncio.create_task(self._run_group(position, row, self.version))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._ready.put(_DONE)

    async def _run_group(self, position: tuple[int, int], row: dict, version: int) -> None:
        started = time.perf_counter()
        try:
            group = await self._sample_group(row, version)
            keep = self._keep(group)
        except BaseException as err:  # the circuit breaker, or a user filter that raised
            self._error, self._stopping = err, True
            self._ready.put(_DONE)
            return
        finally:
            self.running -= self.G
            self.rollout_intervals.append((started, time.perf_counter()))
            self._wake.set()
        if keep:
            self.accepted_samples += self.G
            self._ready.put((position, group))
        else:
            with self._position_lock:
                self._unfinished.discard(position)  # a filtered row is used up, like a trained one
            self._rejected.append(group)

    # ---------------------------------------------------------------- trainer thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()

    def advance_version(self) -> None:
        self.trainer_version += 1
        self.start()
        while self._wake is None:  # the loop thread is still starting
            time.sleep(0.001)
        # The sampler holds the new weights already: count the version now (a checkpoint taken
        # right after must see it), then let the loop re-check its gate.
        with self._position_lock:
            self.version += 1
        self._loop.call_soon_threadsafe(self._wake.set)

    def next_batch(self) -> Optional[RolloutBatch]:
        """Wait for P accepted groups (or the end of the rows) and make the step's batch."""
        self.start()
        waited_from = time.perf_counter()
        accepted: list[PromptGroup] = []
        while len(accepted) < self.P and not self._finished:
            item = self._ready.get()
            if item is _DONE:
                self._finished = True
                if self._error is not None:
                    raise self._error
                break
            position, group = item
            with self._position_lock:
                self._unfinished.discard(position)
            accepted.append(group)
        now = time.perf_counter()
        wait_s = now - waited_from
        train_window = (self._last_batch_at or waited_from, waited_from)  # the previous step trained here
        cycle_s = now - train_window[0]
        self._last_batch_at = now
        rejected = [self._rejected.popleft() for _ in range(len(self._rejected))]
        gate_wait_s, self._gate_wait_s = self._gate_wait_s, 0.0
        return self._make_batch(
            accepted, accepted + rejected, cycle_s,
            **{"perf/trainer_wait_s": wait_s, "perf/sampler_wait_s": gate_wait_s, "async/in_flight": float(self.running),
               "perf/overlap_ratio": self._overlap(*train_window)},
        )

    def state_dict(self) -> dict:
        """Version, gate counters and data position between two steps.

        Rows sampling or queued (not yet trained) are saved as unfinished: a resumed run samples
        them again first, so no row is lost or trained twice.
        """
        with self._position_lock:
            return {**super().state_dict(), "cursor": self.cursor.state_dict(unfinished=sorted(self._unfinished))}

    def load_state_dict(self, state: dict) -> None:
        """Before the first batch: resume the gate as if every trained sample had just been accepted."""
        if self._thread is not None:
            raise RuntimeError("load the producer's state before it starts sampling")
        super().load_state_dict(state)
        self.accepted_samples = self.trained_samples

    def _overlap(self, start: float, end: float) -> float:
        """Fraction of [start, end] (the trainer's last step) during which some rollout ran."""
        if end <= start:
            return 0.0
        intervals = sorted((max(a, start), min(b, end)) for a, b in list(self.rollout_intervals) if b > start and a < end)
        covered, reach = 0.0, start
        for a, b in intervals:
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        self.rollout_intervals = [iv for iv in self.rollout_intervals if iv[1] > end]  # older ones are done with
        return covered / (end - start)

    def close(self) -> None:
        self._stopping = True
        if self._thread is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
            self._thread.join(timeout=60)
        if not self._loop.is_running():
            self._loop.close()
