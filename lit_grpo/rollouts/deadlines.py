"""Deadlines on the user's rollout code: every call is bounded, its errors are classified, and an
event loop that a rollout blocks is detected and named.

- `call_rollout`: one rollout call under `guards.rollout_timeout_s` (cancelled when it expires); a
  transient error (a timeout, `ConnectionError`, `OSError`) is retried with backoff a bounded
  number of times; a bug in the rollout (`TypeError`, `KeyError`, ...) is raised at once with the
  user's traceback; anything else is returned, to be counted as a failure.
- `Heartbeat`: a task on the rollout event loop that stamps the time. A stale stamp means that
  something running on the loop blocks it (`time.sleep`, a blocking HTTP client in an async
  rollout), so no deadline on that loop can fire.
- `LoopWatchdog`: for a loop run on the trainer's own (main) thread. When the heartbeat is stale
  past the deadline it logs where the loop is stuck and interrupts the main thread with a signal;
  the blocked call raises, and the scheduler turns that into `RolloutStalled`. A loop on a
  background thread needs no signal: the trainer thread reads the heartbeat while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Optional

from lit_grpo.errors import EnvironmentFault, UserError
from lit_grpo.samplers.worker import THREAD_PREFIX, join_thread

log = logging.getLogger(__name__)

BUG_ERRORS: tuple[type[BaseException], ...] = (
    TypeError,
    AttributeError,
    LookupError,
    NameError,
    ZeroDivisionError,
    AssertionError,
    ImportError,
    SyntaxError,
    NotImplementedError,
    RecursionError,
)
"""Errors that are bugs in the rollout's code (KeyError and IndexError are LookupErrors): retrying
cannot help and counting them would hide them, so training stops at once with the traceback."""
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError, OSError)
"""Errors of an environment that may recover (a server restarting, a slow tool): retried."""
RETRY_BACKOFF_S = 0.5
"""First pause before a retry; it doubles with every further retry of the same call."""
MAX_BACKOFF_S = 8.0
STALL_EXIT_CODE = 70
"""Exit status when a blocked rollout cannot be interrupted (see `LoopWatchdog`)."""


class RolloutTimeout(TimeoutError):
    """A rollout call did not return within `guards.rollout_timeout_s`; it was cancelled."""


class RolloutStalled(UserError, RuntimeError):
    """Something on the rollout event loop (a blocking call in an async rollout) kept it from
    running for longer than `guards.rollout_timeout_s`; the message names the function and the line."""


def classify(err: BaseException, retry_on: tuple[type[BaseException], ...] = TRANSIENT_ERRORS) -> str:
    """`bug` (stop at once), `fault` (something outside the rollout failed for good, a vLLM server
    after its retries and failover: stop at once, naming it), `transient` (one of `retry_on`:
    retry, then count as a failure) or `failure` (count)."""
    if isinstance(err, EnvironmentFault):
        return "fault"
    if isinstance(err, BUG_ERRORS):
        return "bug"
    if isinstance(err, retry_on):
        return "transient"
    return "failure"


def function_name(fn: Any) -> str:
    """`module.qualname (file:line)` of a rollout function, for error messages."""
    target = getattr(fn, "func", fn)  # functools.partial
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    code = getattr(target, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _expired(err: TimeoutError) -> bool:
    """Whether `err` is the deadline's own (`asyncio.timeout` raises a bare TimeoutError from the
    cancellation it caused), not a TimeoutError the rollout raised itself (a transient error)."""
    return type(err) is TimeoutError and isinstance(err.__cause__, asyncio.CancelledError)


async def call_rollout(
    rollout_fn: Callable[[dict], Awaitable[Any]],
    row: dict,
    *,
    timeout_s: float,
    max_retries: int,
    count: Callable[[str, Optional[BaseException]], None],
    retry_on: tuple[type[BaseException], ...] = TRANSIENT_ERRORS,
) -> Any:
    """`rollout_fn(row)`'s result, or the exception that ended the call (returned, not raised).

    Each attempt is cancelled after `timeout_s` (a `RolloutTimeout`, always retried). Errors of
    `retry_on` are retried up to `max_retries` times, `count("rollout/retries", err)` each time. A bug is
    raised, with a note naming the function. The deadline does not wait for a rollout that
    ignores its cancellation.
    """
    for attempt in range(max_retries + 1):
        try:
            awaitable = rollout_fn(row)
            if not inspect.isawaitable(awaitable):
                raise TypeError(
                    f"the rollout function {function_name(rollout_fn)} returned {type(awaitable).__name__}, "
                    "not an awaitable: it must be `async def rollout_fn(row)`"
                )
            try:
                # In the calling task (no task and no waiter per call: a rollout of a tiny model takes
                # ~1 ms, and those cost a tenth of it); the timeout cancels the rollout where it awaits.
                async with asyncio.timeout(timeout_s):
                    return await awaitable
            except TimeoutError as err:
                if isinstance(err, RolloutTimeout) or not _expired(err):
                    raise
                count("rollout/timeouts", None)
                raise RolloutTimeout(
                    f"the rollout function {function_name(rollout_fn)} did not return within "
                    f"guards.rollout_timeout_s={timeout_s:g} s; it was cancelled"
                ) from None
        except Exception as err:
            kind = "transient" if isinstance(err, RolloutTimeout) else classify(err, retry_on)
            if kind == "fault":
                raise
            if kind == "bug":
                err.add_note(
                    f"raised by the rollout function {function_name(rollout_fn)}: a bug in the rollout stops "
                    "training at once (not retried, not counted)"
                )
                raise
            if kind == "transient" and attempt < max_retries:
                count("rollout/retries", err)
                await asyncio.sleep(min(RETRY_BACKOFF_S * 2**attempt, MAX_BACKOFF_S))
                continue
            return err
    raise AssertionError("unreachable")


async def gather_or_cancel(*awaitables: Awaitable[Any]) -> list[Any]:
    """`asyncio.gather`, but when one raises, the others are cancelled instead of left running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


class Heartbeat:
    """Stamps the time on the event loop every `period_s`; `stale_for()` is how long it has not."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.last = time.monotonic()

    def reset(self) -> None:
        self.last = time.monotonic()

    async def run(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(self.period_s)

    def stale_for(self) -> float:
        return time.monotonic() - self.last


def heartbeat_period(deadline_s: float) -> float:
    return max(min(1.0, deadline_s / 4), 0.01)


def stall_report(stale_s: float, deadline_s: float, thread_id: Optional[int], rollout_fn: Any) -> str:
    """Why and where the rollout event loop is stuck: the rollout function and the thread's stack."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    frames = traceback.extract_stack(frame) if frame is not None else []
    frames = [
        f for f in frames if os.sep + "asyncio" + os.sep not in f.filename
    ] or frames  # the loop's own frames say nothing
    stack = traceback.format_list(frames[-4:]) if frames else ["  (no stack: the thread is gone)\n"]
    return (
        f"the rollout event loop has not run for {stale_s:.1f} s (guards.rollout_timeout_s={deadline_s:g}): a rollout "
        "blocks it (or an engine call of the sampler, with sampler.engine_thread=loop), so no deadline can fire. "
        f"Rollout function: {function_name(rollout_fn)}. The loop's thread is at:\n"
        + "".join(stack)
        + "An async rollout must not block its event loop: use `await asyncio.sleep(...)` instead of time.sleep, an "
        "async client instead of a blocking one, or `await asyncio.to_thread(f, ...)` for blocking work."
    )


class _LoopBlocked(KeyboardInterrupt):
    """Raised in the main thread by the watchdog's signal. A KeyboardInterrupt, because asyncio
    lets only those (and SystemExit) out of a task into the caller of `run_until_complete`."""


class LoopWatchdog:
    """Watches an event loop run on the main thread (`with watchdog.watching(): loop.run_until_complete(...)`).

    When the loop's heartbeat is stale for longer than `deadline_s`, it logs `describe(stale_s, thread_id)`
    and sends SIGUSR2 to the main thread: the blocked call (a sleep, a socket read) is interrupted,
    the handler raises, and `watching()` raises `RolloutStalled` with that description. If the main
    thread cannot be interrupted (the loop runs off the main thread, or the call never returns to
    Python) the process exits with status STALL_EXIT_CODE after `grace_s` more seconds: a run
    must never hang.
    """

    SIGNAL = signal.SIGUSR2

    def __init__(
        self, heartbeat: Heartbeat, deadline_s: float, describe: Callable[[float, int], str], *, grace_s: float = 30.0
    ) -> None:
        self.heartbeat, self.deadline_s, self.describe, self.grace_s = heartbeat, deadline_s, describe, grace_s
        self.report: Optional[str] = None
        """The description of the last stall, once the watchdog fired."""
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._pending = False  # one interruption per stall
        self._thread: Optional[threading.Thread] = None
        self._previous_handler: Any = None
        self._can_interrupt = False
        self._loop_thread_id = _main_thread_id()

    def _start(self) -> None:
        if self._thread is not None:
            return
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(self.SIGNAL, self._on_signal)
            self._can_interrupt = True
        else:
            log.warning(
                "the rollout event loop runs off the main thread: a rollout that blocks it cannot be "
                "interrupted, and the process will exit %s s after guards.rollout_timeout_s instead",
                self.grace_s,
            )
        self._thread = threading.Thread(target=self._watch, name=THREAD_PREFIX + "rollout-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Run the event loop inside; raises `RolloutStalled` when the watchdog had to interrupt it."""
        self._start()
        self._loop_thread_id = threading.get_ident()
        self.report = None
        self.heartbeat.reset()
        self._armed.set()
        try:
            yield
        except _LoopBlocked:
            raise RolloutStalled(self.report or "the rollout event loop was blocked") from None
        finally:
            self._armed.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._armed.is_set() and self._pending:
            self._pending = False
            raise _LoopBlocked()

    def _watch(self) -> None:
        main_id = _main_thread_id()
        while not self._stop.is_set():
            if not self._armed.wait(timeout=60.0) or self._stop.is_set():  # idle between steps: no polling
                continue
            self._stop.wait(self.heartbeat.period_s)
            stale = self.heartbeat.stale_for()
            if self._stop.is_set() or not self._armed.is_set() or self.report is not None or stale <= self.deadline_s:
                continue
            self.report = self.describe(stale, self._loop_thread_id)
            log.error("%s", self.report)
            if self._can_interrupt:
                self._pending = True
                signal.pthread_kill(main_id, self.SIGNAL)
            give_up = time.monotonic() + self.grace_s
            while self._armed.is_set() and time.monotonic() < give_up and not self._stop.is_set():
                self._stop.wait(self.heartbeat.period_s)
            if self._armed.is_set() and not self._stop.is_set():
                log.critical(
                    "the blocked rollout could not be interrupted within %s s; exiting with status %d so the run "
                    "does not hang. %s",
                    self.grace_s,
                    STALL_EXIT_CODE,
                    self.report,
                )
                logging.shutdown()
                os._exit(STALL_EXIT_CODE)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the watchdog's thread and join it (bounded), and give the signal back."""
        self._stop.set()
        self._armed.set()  # wakes the thread from its idle wait; `_stop` makes it leave
        join_thread(self._thread, timeout_s, "the rollout watchdog")
        self._armed.clear()
        if self._can_interrupt and threading.current_thread() is threading.main_thread():
            signal.signal(self.SIGNAL, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL)
            self._can_interrupt = False


def _main_thread_id() -> int:
    ident = threading.main_thread().ident
    assert ident is not None  # the main thread has always started
    return ident
