"""SIGTERM and SIGINT stop a run within seconds, keeping its finished work.

The first signal asks the run to stop. When the trainer is computing, the current step finishes
and its end (the step sequence) writes a checkpoint if checkpoints are configured. When the
trainer is waiting for rollouts (possibly forever: a stalled or hung rollout), the wait is
abandoned at once and the last finished step is checkpointed instead. Either way the run then
writes its summary and metrics and exits with 128 + the signal number (143 for SIGTERM, 130 for
SIGINT), so a preempting scheduler sees a failure and requeues. A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(KeyboardInterrupt):
    """Raised inside a wait for rollouts when a stop signal arrives. A `KeyboardInterrupt`, so that
    asyncio lets it through (an `Exception` landing in a rollout task would count as its failure)."""

    def __init__(self, signum: int, written: str = "") -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.written = written
        """What the stopped run left on disk, as its last line says it (set once it is written)."""

    def report(self) -> str:
        """The stop's last line: `stopped by SIGINT: <what was written>`."""
        return f"{self}: {self.written}" if self.written else str(self)


def quiet_abandoned_work() -> None:
    """After a stop, rollouts still in flight are abandoned on purpose; at the interpreter's exit their
    unstarted coroutines would each print "coroutine ... was never awaited" after the stop's last line."""
    import warnings

    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


class StopSignals:
    """Installs the stop handlers (main thread only; elsewhere it only records nothing).

    Nested ones share the stop: one entered inside another (the CLI's, from the process's start,
    then `train`'s around the run) starts with the signal the outer one received, and hands its own
    back when it exits.
    """

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        """The first stop signal received, if any."""
        self._waiting = False
        self._redelivering = False
        self._previous: dict[int, Any] = {}
        self._previous_unraisable_hook: Optional[Callable[[Any], object]] = None
        self._outer: Optional[StopSignals] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = previous = signal.signal(signum, self._handle)
                if isinstance(outer := getattr(previous, "__self__", None), StopSignals):
                    self._outer = outer
            if self._outer is not None and self.signum is None:
                self.signum = self._outer.signum
            self._previous_unraisable_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._previous_unraisable_hook is not None:
            sys.unraisablehook, self._previous_unraisable_hook = self._previous_unraisable_hook, None
        if self._outer is not None and self._outer.signum is None:
            self._outer.signum = self.signum

    def _handle(self, signum: int, frame) -> None:
        if self._redelivering:  # the stop a garbage collection swallowed, sent again (`_unraisable`)
            self._redelivering = False
            if self._waiting:
                raise StopRequested(signum)
            return
        if self.signum is not None:  # the second signal: no more waiting
            print(f"\n{signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: stopping after the current step (send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )
        if self._waiting:
            raise StopRequested(signum)

    def _unraisable(self, unraisable) -> None:
        """The stop raised where Python cannot raise it (a `__del__` or weakref callback that a garbage
        collection ran during the wait) is only printed, and the wait goes on, possibly forever. Send
        the signal again a moment later, so that it lands in the wait itself."""
        if not isinstance(unraisable.exc_value, StopRequested):
            (self._previous_unraisable_hook or sys.__unraisablehook__)(unraisable)
            return
        self._redelivering = True
        main = threading.main_thread().ident
        threading.Timer(0.01, signal.pthread_kill, (main, unraisable.exc_value.signum)).start()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait (for rollouts) that a stop signal abandons by raising `StopRequested`."""
        if self.signum is not None:
            raise StopRequested(self.signum)
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False
