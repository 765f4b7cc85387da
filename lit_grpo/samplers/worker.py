"""The threads a run starts: their common name prefix, their bounded join, and the sampler's
engine thread (one daemon worker that runs the batched engine calls).

Every thread lit_grpo starts is named `THREAD_PREFIX + <what it does>` (`lit_grpo-sampler`,
`lit_grpo-rollout-watchdog`, `lit_grpo-rollout-scheduler`, `lit_grpo-vllm-server-client`) and is
stopped and joined when its owner closes (`join_thread`: bounded, a thread stuck in an engine call
is abandoned with a warning). `run_threads()` lists the ones still alive: none, once a run returned.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Optional

log = logging.getLogger(__name__)
THREAD_PREFIX = "lit_grpo-"
"""The name prefix of every thread lit_grpo starts."""


def run_threads() -> list[threading.Thread]:
    """The threads lit_grpo started that are still alive."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def join_thread(thread: Optional[threading.Thread], timeout_s: float, what: str) -> bool:
    """Join `thread` for at most `timeout_s`; True when it ended. A thread still alive then (stuck
    in a call that cannot be interrupted) is left to run as a daemon, with a warning naming `what`."""
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning(
            "%s (thread %s) did not end within %g s of the run's end; it is abandoned", what, thread.name, timeout_s
        )
        return False
    return True


class DaemonWorker(Executor):
    """One daemon worker thread. Unlike a ThreadPoolExecutor's, it is not joined at interpreter
    exit, so an engine call that never returns cannot keep a stopped run's process alive; `close`
    (the owner's) stops and joins it with a bound."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=THREAD_PREFIX + name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:
                    future.set_exception(err)

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    def close(self, timeout_s: float) -> bool:
        """Drop the queued calls, let a running one finish for at most `timeout_s`, and join the
        thread; True when it ended (else it is abandoned, with a warning)."""
        self.shutdown(wait=False, cancel_futures=True)
        return join_thread(self._thread, timeout_s, "the sampler's engine call")

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        self._jobs.put(None)
        if wait:
            self._thread.join()
