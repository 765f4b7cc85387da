"""In-flight weight updates for the vLLM server sampler (`offpolicy.partial_rollouts: true`): a weight sync
interrupts the completions being generated, and each goes on, after the sync, from where it was,
on the new weights; every token is tagged with the version of the weights that produced it.

How the versions are known exactly, with no help from the server: completions are streamed
(`stream: true`, token ids and logprobs in every chunk), and a sync first closes every stream in
flight (`InFlightStreams.interrupt`), then pauses the servers and loads the new weights. A token
the client received before it closed the stream was generated before the pause, so by the old
weights; whatever the server generated after the close is never read. After the sync, each
unfinished completion is sent again as a continuation: the prompt plus the tokens it already has,
asking for the tokens it still may generate, and those come from the new weights. No request
starts while a sync runs, so a request's tokens all carry the version it was sent at.

The continuation recomputes the prefix's KV cache on the new weights, which vLLM's in-place
reload (`/reset_prefix_cache` with running requests) does too. A stop string that straddles an
interruption is not seen by the server (it checks the new text only): the sampler cuts every
interrupted completion itself, by the same rule (`lit_grpo.samplers.stops.find_stop`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Optional

from lit_grpo.samplers.arguments import SamplerTimeout
from lit_grpo.samplers.server.answers import PartialChoice, completion_request
from lit_grpo.samplers.server.requests import ReplicaRouter, TransientError
from lit_grpo.samplers.server.weight_files import ServerError

INTERRUPT_WAIT_S = 10.0
"""How long a sync waits for the streams it closed to end (closing a connection is immediate; a
stream that outlives this is left to end on its own, its tokens unread)."""


class InFlightStreams:
    """The streamed requests in flight, which a weight sync interrupts. A request starts only while
    no sync runs (`start`), tagged with the version served then; a sync closes every stream
    (`interrupt`) before the servers pause and opens the gate again at the new version (`reopen`).
    Everything runs on the sampler's own event loop."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.interruptions = 0
        """Streams a sync closed before they finished."""
        self._tasks: set[asyncio.Task] = set()
        self._open: Optional[asyncio.Event] = None

    @property
    def open(self) -> asyncio.Event:
        if self._open is None:  # made on the loop that uses it
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def start(self, stream: Callable[[int], Coroutine[Any, Any, Any]]) -> asyncio.Task:
        """`stream(version)` as a task, once no sync runs; `version` is what the servers serve then."""
        while not self.open.is_set():
            await self.open.wait()
        # No await between the check and the task's registration: a sync that begins later sees it.
        task = asyncio.get_running_loop().create_task(stream(self.version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def interrupt(self) -> int:
        """Close the gate and every stream in flight; returns how many were closed."""
        self.open.clear()
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=INTERRUPT_WAIT_S)
        self.interruptions += len(tasks)
        return len(tasks)

    async def hold(self, work: Coroutine[Any, Any, Any], version: int, *, interrupt: bool) -> None:
        """`work` (a weight sync) with no request starting meanwhile; with `interrupt` the streams in
        flight are closed first. After it requests start again, at `version` if `work` finished,
        else at the version before."""
        previous = self.version
        if interrupt:
            await self.interrupt()
        else:
            self.open.clear()
        done = False
        try:
            await work
            done = True
        finally:
            self.reopen(version if done else previous)

    def reopen(self, version: int) -> None:
        """Requests may start again, at `version`."""
        self.version = version
        self.open.set()


async def stream_completions(
    router: ReplicaRouter,
    streams: InFlightStreams,
    prompt: list[int],
    body_args: tuple[float, int, tuple[str, ...]],
    n: int,
    deadline: Optional[float],
    *,
    eos_id: Optional[int],
    max_retries: int,
) -> list[PartialChoice]:
    """`n` completions of `prompt`, streamed (`body_args`: temperature, max_tokens and the stop
    strings sent to the server). A weight sync cancels the streams; each unfinished completion is
    then sent again from where it was (prompt + its tokens so far, for the tokens it may still
    generate), those with the same tokens so far as one request. A transient failure also goes on
    from where it was, at most `max_retries` times in a row; a replica still unreachable then is
    dropped while others are left."""
    temperature, max_tokens, server_stop = body_args
    choices = [PartialChoice() for _ in range(n)]
    failures = 0
    while unfinished := [c for c in choices if not c.finished]:
        if deadline is not None and time.monotonic() >= deadline:
            raise SamplerTimeout("no completion within http_timeout (interrupted by weight syncs)")
        by_prefix: dict[tuple[int, ...], list[PartialChoice]] = {}
        for c in unfinished:
            if c.tokens and (c.tokens[-1] == eos_id or len(c.tokens) >= max_tokens):  # ended as it was cut
                c.finish_reason = "stop" if c.tokens[-1] == eos_id else "length"
                continue
            by_prefix.setdefault(tuple(c.tokens), []).append(c)
        tasks = []
        try:
            for prefix, group in by_prefix.items():
                body = completion_request(prompt + list(prefix), temperature, max_tokens - len(prefix), server_stop)
                for c in group:
                    c.requests += 1
                tasks.append(await streams.start(functools.partial(router.stream, body, group, deadline=deadline)))
            if tasks:
                await asyncio.wait(tasks)
        finally:
            for task in tasks:  # this caller was cancelled: its streams close too
                task.cancel()
        errors: list[TransientError] = []
        for task in tasks:
            if task.cancelled() or (failed := task.exception()) is None:
                continue
            if not isinstance(failed, TransientError):
                raise failed
            errors.append(failed)
        if not errors:  # every stream finished, or a sync interrupted it: go on from where they are
            failures = 0
            continue
        failures += 1
        err = errors[0]
        if failures > max_retries:
            others = [r for r in router.live() if r is not err.replica]
            if not err.unreachable or err.replica is None or not others:
                raise ServerError(f"a streamed completion failed {failures} times; last: {err}")
            await router.drop(err.replica, f"unreachable after {failures} tries: {err}")
            failures = 0
        await asyncio.sleep(min(router.retry_backoff_s * 2 ** max(failures - 1, 0), 5.0))
    return choices
