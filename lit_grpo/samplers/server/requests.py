"""Requests to a set of vLLM server replicas: routing, bounded concurrency, retries, failover, and
merging the concurrent requests for one prompt into one `n=k` request.

Everything here runs on the vllm_server sampler's own event loop (`lit_grpo.samplers.server.sampler`).
It speaks HTTP through an `httpx.AsyncClient` and never imports vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.samplers.arguments import SamplerTimeout
from lit_grpo.samplers.server.answers import PartialChoice, read_chunk
from lit_grpo.samplers.server.weight_files import ServerError

log = logging.getLogger("lit_grpo.samplers.server.sampler")

COALESCE_WINDOW_S = 0.002
"""How long the first request for a prompt waits for others with the same prompt and sampling
arguments (a rollout's G calls arrive within a millisecond) before they go out as one request."""
MAX_BACKOFF_S = 5.0


@dataclass
class Replica:
    """One server, as the client sees it."""

    url: str
    model: str = ""
    """The served model name (`/v1/models`), sent with every request."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the server accepts (`/v1/models`)."""
    in_flight: int = 0
    """Completions (not requests) this replica is generating for us now."""
    completed: int = 0
    """Completions this replica returned."""
    version: Optional[int] = None
    """The weight version the server reported after the last sync (None: unknown)."""
    down: Optional[str] = None
    """Why the replica was dropped (None: in use)."""


def key_refused(url: str) -> str:
    return (
        f"vLLM server {url} answered 401: it needs its key, and lit_grpo sent none or another one "
        "(the key is read from the environment variable sampler.api_key_env names, LIT_GRPO_SERVER_KEY by default)"
    )


def _with_model_and_n(body: dict, path: str, model: str, n: int) -> dict:
    if path == "/v1/completions":
        return {**body, "model": model, "n": n}
    return {**body, "model": model, "sampling_params": {**body["sampling_params"], "n": n}}


class TransientError(Exception):
    """An error worth retrying (connection refused or reset, 5xx, 429, a timeout)."""

    def __init__(self, message: str, *, unreachable: bool, replica: Optional[Replica] = None) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.replica = replica
        """The replica that failed, where the raiser names it (`ReplicaRouter.stream`)."""


class ReplicaRouter:
    """Sends completion requests to the live replica with the fewest completions in flight, at
    most `max_in_flight` each (a request of `n` completions counts `n`; one larger than the bound
    goes alone to an idle replica). A transient error is retried on the same replica with
    exponential backoff, up to `max_retries` times; a replica that stays unreachable is dropped
    with a warning naming it and its requests go to the others; with none left, or when a replica
    answers errors or times out past its retries, the request fails with a `ServerError` naming it.
    """

    def __init__(
        self,
        urls: list[str],
        client: Any,
        httpx: Any,
        *,
        max_in_flight: int,
        request_timeout_s: float,
        max_retries: int,
        retry_backoff_s: float,
    ) -> None:
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.client, self.httpx = client, httpx
        self.max_in_flight, self.request_timeout_s = max_in_flight, request_timeout_s
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.failovers: list[str] = []
        """One line per replica dropped (why), in order."""
        self._slots = asyncio.Condition()

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.down is None]

    async def call(self, r: Replica, method: str, path: str, *, timeout: float, **kwargs: Any) -> Any:
        """One HTTP call to replica `r`, no retries: its JSON (its text if not JSON, None when empty); `ServerError`
        naming the server for a transport error or a non-2xx answer."""
        try:
            response = await self.client.request(method, f"{r.url}{path}", timeout=timeout, **kwargs)
        except self.httpx.TimeoutException:
            raise ServerError(f"vLLM server {r.url}: {method} {path} did not answer within {timeout:g} s") from None
        except self.httpx.TransportError as err:
            raise ServerError(
                f"vLLM server {r.url}: {method} {path} failed ({type(err).__name__}: {err or 'no detail'})"
            ) from None
        if response.status_code == 401:
            raise ServerError(key_refused(r.url))
        if response.status_code >= 300:
            raise ServerError(
                f"vLLM server {r.url}: {method} {path} answered {response.status_code}: {response.text[:500]}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:  # a plain-text answer (`/v1/load_lora_adapter`: "Success: ...")
            return response.text

    async def complete(
        self, body: dict, n: int, deadline: Optional[float], path: str = "/v1/completions"
    ) -> tuple[Replica, list[dict]]:
        """The `n` choices of one `/v1/completions` request (`body` without `model` and `n`), in
        index order, and the replica that answered; retried and failed over as the class says.
        `deadline` (monotonic seconds, None: none) bounds the whole, with `SamplerTimeout`. With
        `path` `/inference/v1/generate` (`answers.generate_request`), `n` goes in its sampling
        parameters and each choice gets the answer's `prompt_token_ids`."""
        while True:  # one pass per replica tried: retries stay on a replica until it is dropped
            replica = await self._acquire(n)
            try:
                failures = 0
                while replica.down is None:
                    timeout = self.request_timeout_s
                    if deadline is not None:
                        timeout = min(timeout, deadline - time.monotonic())
                        if timeout <= 0:
                            raise SamplerTimeout(f"no completion within http_timeout (server {replica.url})")
                    try:
                        choices = await self._post(
                            replica, _with_model_and_n(body, path, replica.model, n), timeout, path
                        )
                        if len(choices) != n:
                            raise ServerError(
                                f"vLLM server {replica.url} answered {len(choices)} choices, asked for {n}"
                            )
                        replica.completed += n
                        return replica, sorted(choices, key=lambda c: c.get("index", 0))
                    except TransientError as err:
                        failures += 1
                        if deadline is not None and time.monotonic() >= deadline:
                            raise SamplerTimeout(
                                f"no completion within http_timeout; the last try failed: {err}"
                            ) from None
                        if failures > self.max_retries:
                            if not err.unreachable:
                                raise ServerError(
                                    f"vLLM server {replica.url} failed a completion request {failures} "
                                    f"times; last: {err}"
                                ) from None
                            await self.drop(replica, f"unreachable after {failures} tries: {err}")
                            break
                        backoff = min(self.retry_backoff_s * 2 ** (failures - 1), MAX_BACKOFF_S)
                        if deadline is not None:
                            backoff = min(backoff, max(deadline - time.monotonic(), 0.0))
                        await asyncio.sleep(backoff)
            finally:
                await self._release(replica, n)

    async def stream(
        self, body: dict, choices: list[PartialChoice], version: int, deadline: Optional[float]
    ) -> Replica:
        """One streamed `/v1/completions` request for `len(choices)` completions (`body` without
        `model`, `n` and `stream`) on the least loaded live replica, its chunks read into `choices`
        as they arrive, their tokens tagged with `version` (`partial.read_chunk`). No retries here:
        a transient failure raises `TransientError` naming the replica, with what was read kept in
        `choices`, and the caller goes on from there (`VLLMServerSampler`); cancelling it closes
        the stream, and the server then drops the request."""
        n = len(choices)
        replica = await self._acquire(n)
        try:
            timeout = self.request_timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    raise SamplerTimeout(f"no completion within http_timeout (server {replica.url})")
            request = {**body, "model": replica.model, "n": n, "stream": True}
            try:
                async with self.client.stream(
                    "POST", f"{replica.url}/v1/completions", json=request, timeout=timeout
                ) as response:
                    if response.status_code >= 300:
                        text = (await response.aread()).decode(errors="replace")
                        self._raise_for_status(replica, response.status_code, text)
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[len("data:") :].strip()
                        if data == "[DONE]":
                            break
                        read_chunk(replica.url, json.loads(data), choices, version, body["prompt"])
            except self.httpx.TimeoutException:
                raise TransientError(
                    f"{replica.url}: no chunk within {timeout:g} s", unreachable=False, replica=replica
                ) from None
            except self.httpx.TransportError as err:  # refused, reset, closed mid-stream
                why = f"{type(err).__name__}: {err or 'connection failed'}"
                raise TransientError(f"{replica.url}: {why}", unreachable=True, replica=replica) from None
            if not all(c.finished for c in choices):
                raise TransientError(
                    f"{replica.url}: the stream ended before its completions did", unreachable=False, replica=replica
                )
            replica.completed += n
            return replica
        finally:
            await self._release(replica, n)

    @staticmethod
    def _raise_for_status(r: Replica, status: int, text: str) -> None:
        """A 5xx or 429 is worth retrying (`TransientError`); any other refusal is final (`ServerError`)."""
        if status == 401:
            raise ServerError(key_refused(r.url))
        if status >= 500 or status == 429:
            raise TransientError(f"{r.url} answered {status}: {text[:300]}", unreachable=False, replica=r)
        raise ServerError(f"vLLM server {r.url} refused a completion request ({status}): {text[:500]}")

    async def _post(self, r: Replica, body: dict, timeout: float, path: str = "/v1/completions") -> list[dict]:
        try:
            response = await self.client.post(f"{r.url}{path}", json=body, timeout=timeout)
        except self.httpx.TimeoutException:
            raise TransientError(f"{r.url}: no answer within {timeout:g} s", unreachable=False) from None
        except self.httpx.TransportError as err:  # refused, reset, closed mid-answer
            raise TransientError(
                f"{r.url}: {type(err).__name__}: {err or 'connection failed'}", unreachable=True
            ) from None
        if response.status_code >= 300:
            self._raise_for_status(r, response.status_code, response.text)
        answer = response.json()
        prompt = answer.get("prompt_token_ids")  # `/inference/v1/generate` answers it once, not per choice
        return [{**c, "prompt_token_ids": prompt} if prompt is not None else c for c in answer["choices"]]

    async def _acquire(self, n: int) -> Replica:
        """A live replica with room for `n` more completions, the least loaded one."""
        async with self._slots:
            while True:
                live = self.live()
                if not live:
                    raise ServerError("no vLLM server left: " + "; ".join(self.failovers))
                free = [r for r in live if r.in_flight == 0 or r.in_flight + n <= self.max_in_flight]
                if free:
                    replica = min(free, key=lambda r: r.in_flight)
                    replica.in_flight += n
                    return replica
                await self._slots.wait()

    async def _release(self, r: Replica, n: int) -> None:
        async with self._slots:
            r.in_flight -= n
            self._slots.notify_all()

    async def drop(self, r: Replica, why: str) -> None:
        """Take `r` out of use (its requests go to the others), saying so."""
        async with self._slots:
            if r.down is None:
                r.down = why
                self.failovers.append(f"{r.url}: {why}")
                log.warning(
                    "vLLM server %s is gone (%s): dropped; %d server(s) left serve its requests",
                    r.url,
                    why,
                    len(self.live()),
                )
            self._slots.notify_all()


@dataclass
class _Waiting:
    """The callers waiting on one merged request: (their n, their future), in arrival order."""

    waiters: list[tuple[int, asyncio.Future]] = field(default_factory=list)
    deadline: Optional[float] = None
    no_deadline: bool = False
    task: Optional[asyncio.Task] = None


class Coalescer:
    """Merges concurrent requests with equal keys (prompt and sampling arguments) that arrive
    within `COALESCE_WINDOW_S` into one call of `send(n, deadline)`, whose results are dealt out in
    arrival order. A rollout asks for its G completions one at a time: sent as one `n=G` request
    they cost one HTTP round trip, one prompt tokenization check and one prefill on the server.
    A caller that gives up (its deadline, cancellation) leaves the others waiting; when every
    caller of a merged request gave up, the request is cancelled, on the server too."""

    def __init__(self, window_s: float = COALESCE_WINDOW_S, max_n: int = 64) -> None:
        self.window_s, self.max_n = window_s, max_n
        self._open: dict[Hashable, _Waiting] = {}

    async def request(
        self, key: Hashable, n: int, deadline: Optional[float], send: Callable[[int, Optional[float]], Awaitable[list]]
    ) -> list:
        """`n` results for `key`, from a merged `send`."""
        waiting = self._open.get(key)
        if waiting is None or sum(k for k, _ in waiting.waiters) + n > self.max_n:
            waiting = self._open[key] = _Waiting()
            waiting.task = asyncio.get_running_loop().create_task(self._send(key, waiting, send))
        future = asyncio.get_running_loop().create_future()
        waiting.waiters.append((n, future))
        if deadline is None:
            waiting.no_deadline = True
        elif waiting.deadline is None or deadline > waiting.deadline:
            waiting.deadline = deadline
        future.add_done_callback(lambda _: self._maybe_cancel(waiting))
        return await future

    async def _send(
        self, key: Hashable, waiting: _Waiting, send: Callable[[int, Optional[float]], Awaitable[list]]
    ) -> None:
        await asyncio.sleep(self.window_s)
        if self._open.get(key) is waiting:
            del self._open[key]
        live = [(k, f) for k, f in waiting.waiters if not f.done()]
        if not live:
            return
        try:
            results = await send(sum(k for k, _ in live), None if waiting.no_deadline else waiting.deadline)
        except asyncio.CancelledError:
            for _, f in live:
                f.cancel()
            raise
        except BaseException as err:  # every caller of the merged request sees its failure
            for _, f in live:
                if not f.done():
                    f.set_exception(err)
            return
        start = 0
        for k, f in live:
            if not f.done():
                f.set_result(results[start : start + k])
            start += k

    def _maybe_cancel(self, waiting: _Waiting) -> None:
        """Cancel a merged request no caller waits for any more (all timed out or cancelled)."""
        task = waiting.task
        if task is not None and not task.done() and all(f.done() for _, f in waiting.waiters):
            if any(f.cancelled() for _, f in waiting.waiters):
                task.cancel()
