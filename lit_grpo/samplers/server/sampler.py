"""The vLLM server sampler: completions from one or more vLLM OpenAI servers over HTTP.

Prompts are tokenized here, in the training process, and sent as token ids to `/v1/completions`
(with `return_token_ids` and the sampled tokens' logprobs), so the tokens trained on are exactly
the tokens the server saw and sampled. Concurrent requests for the same prompt and sampling
arguments (a rollout's G calls) go out as one request with `n` set to their number. The servers must run
with `--logprobs-mode processed_logprobs` (as `python -m lit_grpo.serve` sets): the served
logprobs are then the behaviour policy's (after temperature; top_p=1, top_k=0), and the raw ones
(`inference_logprobs`) are known where they are the same numbers, at temperature 1 and in greedy
decoding, as with the in-process vLLM sampler. The eos cut and the stop-string contract are the
other samplers' (`BatchingSampler.completion`, `lit_grpo.samplers.stops`): vLLM ends a completion
with the token that completed a stop string, keeps its logprob and cuts the text before it (the
OpenAI API takes at most 4 stop strings: with more, the cut is made here by the same rule).

Requests go to the live replica with the fewest completions in flight, are retried and fail over
(`lit_grpo.samplers.server.requests`); a weight sync (`update_weights`) pauses every live
replica, loads the new weights (from a safetensors file in `weight_sync_dir`, or streamed by
vLLM's weight-transfer API), then resumes them (`lit_grpo.samplers.server.weight_files`): a
replica that fails a sync is dropped, and losing the last raises `WeightSyncError` naming it.
With `partial_rollouts` (`enable_partial_rollouts`), completions are streamed and a sync
interrupts them; each goes on after it on the new weights, every token tagged with the version
that produced it (`Completion.token_versions`; `lit_grpo.samplers.server.partial`).

This module does not import vLLM; it needs `httpx` (`pip install 'lit_grpo[server]'`). The servers
need the dev-mode endpoints (`VLLM_SERVER_DEV_MODE=1`, set by `lit_grpo.samplers.server.serve`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from lit_grpo.samplers.arguments import PromptTooLong, SamplerTimeout, check_sample_kwargs
from lit_grpo.samplers.base import BatchingSampler
from lit_grpo.samplers.server.adapters import AdapterSync
from lit_grpo.samplers.server.answers import (
    GENERATE_PATH,
    completion_request,
    describe_replica,
    generate_request,
    image_content_parts,
    read_completion,
    read_generated,
)
from lit_grpo.samplers.server.keys import auth_headers
from lit_grpo.samplers.server.partial import InFlightStreams, stream_completions
from lit_grpo.samplers.server.requests import Coalescer, Replica, ReplicaRouter
from lit_grpo.samplers.server.scoring import ServerScoring
from lit_grpo.samplers.server.weight_files import (  # noqa: F401 (ServerError, WeightSyncError re-exported)
    ServerError,
    ServerWeightSync,
    WeightSyncError,
    served_versions,
    sync_replicas,
    tag_version,
    write_weight_file,
)
from lit_grpo.samplers.stops import find_stop
from lit_grpo.samplers.worker import THREAD_PREFIX, join_thread
from lit_grpo.types import Completion, PromptImages

if TYPE_CHECKING:
    from lit_grpo.samplers.server.pool import ServerPool

log = logging.getLogger(__name__)
CANCEL_WAIT_S = 2.0
"""How long the run's end gives the requests it cancels to close their connections."""
T = TypeVar("T")

MAX_SERVER_STOPS = 4
"""The OpenAI API takes at most 4 stop strings; with more, none are sent and the completion is cut
here (`stops.find_stop`, vLLM's rule), after the server generated past the stop string."""
INSTALL_HINT = "sampler=vllm_server needs httpx: pip install 'lit_grpo[server]'"


class VLLMServerSampler(ServerScoring, AdapterSync, ServerWeightSync, BatchingSampler):
    """Implements the `Sampler` protocol over vLLM OpenAI servers at `urls` (see the module docstring).

    All HTTP runs on one event loop in a daemon thread of its own, so rollouts on any event loop,
    the evaluator's synchronous `generate` and the trainer's `update_weights` share one
    connection pool and one in-flight bound per server. `pool`: servers this sampler started and
    stops in `close()`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        urls: list[str],
        *,
        weight_sync_dir: str | os.PathLike,
        max_in_flight_per_server: int = 64,
        request_timeout_s: float = 120.0,
        max_retries: int = 3,
        sync_timeout_s: float = 300.0,
        retry_backoff_s: float = 0.5,
        pool: Optional[ServerPool] = None,
        max_batch_size: int = 256,
        weight_transfer: str = "reload",
        weight_transfer_address: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> None:
        try:
            import httpx
        except ImportError as err:
            raise ImportError(f"{INSTALL_HINT} ({err})") from None
        if not urls:
            raise ValueError("VLLMServerSampler needs at least one server URL")
        super().__init__(tokenizer, max_batch_size=max_batch_size)
        self._httpx = httpx
        for name in ("httpx", "httpcore"):  # a line per request at INFO would drown the run's log
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self.router = ReplicaRouter(
            urls,
            None,
            httpx,
            max_in_flight=max_in_flight_per_server,
            request_timeout_s=request_timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
        )
        self._coalescer = Coalescer()
        self._headers = auth_headers(api_key)  # sent on every request; never logged
        self.weight_sync_dir = Path(weight_sync_dir)
        self.max_in_flight_per_server = max_in_flight_per_server
        self.request_timeout_s = request_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self.pool = pool
        self.transport = None
        """`weight_transfer` other than reload: the `WeightTransport` that streams the weights."""
        if weight_transfer != "reload":
            from lit_grpo.samplers.server.weight_transfer import WeightTransport

            self.transport = WeightTransport(weight_transfer, timeout_s=sync_timeout_s, address=weight_transfer_address)
        self.partial_rollouts = False
        """True: completions are streamed; a weight sync interrupts and continues them (`enable_partial_rollouts`)."""
        self.sent_images = False
        """Whether a prompt with images was sampled: a weight sync then drops the servers' cached image features."""
        self.max_retries = max_retries
        self._streams = InFlightStreams()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=THREAD_PREFIX + "vllm-server-client", daemon=True
        )
        self._thread.start()
        try:
            self._run(self._open(), timeout=request_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def replicas(self) -> list[Replica]:
        return self.router.replicas

    @property
    def version(self) -> int:
        """The version of the weights every live replica serves: weight syncs done, unless set
        (the run's policy version, so that token versions and the off-policy gate count alike)."""
        return self._streams.version

    @version.setter
    def version(self, value: int) -> None:
        self._streams.version = int(value)

    @property
    def interruptions(self) -> int:
        """Completions a weight sync interrupted (and continued) so far."""
        return self._streams.interruptions

    def enable_partial_rollouts(self) -> None:
        """Stream completions, and let a weight sync interrupt them: each goes on after the sync on
        the new weights, its tokens tagged with the version of the weights that produced them."""
        self.partial_rollouts = True

    @property
    def failovers(self) -> list[str]:
        """One line per replica dropped (why), in order."""
        return self.router.failovers

    # ------------------------------------------------------------------ the client's own loop

    def _run(self, coro: Coroutine[Any, Any, T], timeout: Optional[float]) -> T:
        """Run `coro` on the client's loop from any other thread, waiting at most `timeout` s."""
        self._check_open()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def _check_open(self) -> None:
        if self._closed or not self._loop.is_running():
            raise RuntimeError("the vllm_server sampler is closed")

    async def _open(self) -> None:
        """The HTTP client, and each server's model name and length limit from `/v1/models`."""
        capacity = len(self.replicas) * self.max_in_flight_per_server + 16
        # trust_env=False: a proxy from the environment must never stand between us and the servers.
        self._client = self.router.client = self._httpx.AsyncClient(
            trust_env=False,
            headers=self._headers,
            limits=self._httpx.Limits(max_connections=capacity, max_keepalive_connections=capacity),
        )
        await asyncio.gather(*(describe_replica(self.router.call, r, self.request_timeout_s) for r in self.replicas))

    # ------------------------------------------------------------------ sampling

    takes_images = True

    async def sample_with_prompt_tokens(
        self,
        prompt_token_ids: list[int],
        n: int = 1,
        *,
        multi_modal: Optional[dict[str, torch.Tensor]] = None,
        **kwargs: Any,
    ) -> list[Completion]:
        """`n` completions of a tokenized prompt (with `multi_modal`, a `PromptImages`: the images its
        placeholders stand for, sent to `/inference/v1/generate`), `kwargs` the sampling arguments of
        `check_sample_kwargs`. Sent with the concurrent requests for the same prompt, images and
        arguments as one request (`requests.Coalescer`). `http_timeout` bounds this call as a whole,
        retries included (`SamplerTimeout` past it); a merged request no caller waits for any more
        is cancelled on the server's side too."""
        args = check_sample_kwargs(kwargs)
        self._check_open()
        self._refuse_if_cancelled()
        prompt = [int(t) for t in prompt_token_ids]
        images = self._images_of(multi_modal)
        max_tokens = self._bounded_max_tokens(len(prompt), args.max_tokens, args.max_seq_len)
        deadline = None if args.http_timeout is None else time.monotonic() + args.http_timeout
        key = (tuple(prompt), args.temperature, max_tokens, args.stop, id(images) if images else None)
        send = functools.partial(self._complete, prompt, args.temperature, max_tokens, args.stop, images=images)
        future = asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._coalescer.request(key, n, deadline, send), self._loop)
        )
        try:
            return list(await asyncio.wait_for(future, args.http_timeout))
        except TimeoutError as err:
            if isinstance(err, SamplerTimeout):
                raise
            raise SamplerTimeout(
                f"no completion within http_timeout={args.http_timeout:g} s (waiting for a free "
                "server slot or for the server); the request was cancelled"
            ) from None
        finally:
            future.cancel()  # the caller was cancelled or timed out: it stops waiting on the client's loop too

    def _images_of(self, multi_modal: Optional[dict]) -> Optional[PromptImages]:
        """The prompt's `PromptImages` (None: text); `ValueError` for images the servers cannot take:
        tensors alone (the server needs the images themselves), or with partial rollouts (whose
        streams go to `/v1/completions`, which takes no images)."""
        if not multi_modal:
            return None
        if self.partial_rollouts:
            raise ValueError(
                "the vllm_server sampler cannot stream a prompt with images as a partial rollout: "
                "set offpolicy.partial_rollouts=false for a vision-language policy"
            )
        images = multi_modal if isinstance(multi_modal, PromptImages) else PromptImages(multi_modal)
        images.engine_prompt([])  # refuses tensors alone, saying what to do
        self.sent_images = True  # from now on a weight sync also drops the servers' cached image features
        return images

    def _bounded_max_tokens(self, prompt_len: int, max_tokens: int, request_max_seq_len: Optional[int]) -> int:
        """`max_tokens` within `data.max_seq_len`, the request's `max_seq_len` and the servers'
        `max_model_len`; `PromptTooLong` when a bound leaves no room (as in `BatchingSampler`)."""
        for bound, name in (
            (self.max_seq_len, "data.max_seq_len"),
            (request_max_seq_len, "the request's max_seq_len"),
            (self._max_model_len(), "the servers' max_model_len"),
        ):
            if bound is None:
                continue
            if prompt_len >= bound:
                raise PromptTooLong(
                    f"a prompt of {prompt_len} tokens leaves no room for a completion within "
                    f"{name}={bound}; it was not sampled"
                )
            max_tokens = min(max_tokens, bound - prompt_len)
        return max_tokens

    def _max_model_len(self) -> Optional[int]:
        lens = [r.max_model_len for r in self.replicas if r.max_model_len]
        return min(lens) if lens else None

    def _generate(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        multi_modal: Optional[list[Optional[dict[str, torch.Tensor]]]] = None,
    ) -> list[Completion]:
        """The batched call of the synchronous `generate` (greedy evaluation): one request per
        prompt, all in flight together, waited for at most `call_timeout_s`."""
        images = [self._images_of(m) for m in multi_modal] if multi_modal is not None else [None] * len(prompts)

        async def gather() -> list[Completion]:
            per_prompt = await asyncio.gather(
                *(
                    self._complete(list(p), temperature, max_tokens, tuple(stop), 1, None, images=im)
                    for p, im in zip(prompts, images)
                )
            )
            return [c for completions in per_prompt for c in completions]

        try:
            return self._run(gather(), timeout=self.call_timeout_s)
        except TimeoutError:
            raise SamplerTimeout(
                f"{len(prompts)} requests to the vLLM servers did not all complete within "
                f"{self.call_timeout_s:g} s (guards.rollout_timeout_s)"
            ) from None

    async def _complete(
        self,
        prompt: list[int],
        temperature: float,
        max_tokens: int,
        stop: tuple[str, ...],
        n: int,
        deadline: Optional[float],
        *,
        images: Optional[PromptImages] = None,
    ) -> list[Completion]:
        """`n` completions of `prompt` from one request (see `ReplicaRouter.complete`), or, with
        partial rollouts, from streamed requests that a weight sync may interrupt (`_complete_partial`).
        Greedy (`temperature` 0): one completion asked for and copied `n` times (vLLM refuses `n` > 1
        in greedy sampling, and its n completions would be the same). A prompt with `images` goes
        to `/inference/v1/generate` with them (`answers.generate_request`)."""
        if temperature == 0.0 and n > 1:
            (one,) = await self._complete(prompt, temperature, max_tokens, stop, 1, deadline, images=images)
            return [one, *(copy.deepcopy(one) for _ in range(n - 1))]
        server_stop = stop if len(stop) <= MAX_SERVER_STOPS else ()
        if images is not None:
            content = image_content_parts(images.images or [])
            body = generate_request(images.engine_prompt(prompt), content, temperature, max_tokens, server_stop)
            replica, choices = await self.router.complete(body, n, deadline, path=GENERATE_PATH)
            return [self._cut(prompt, *read_generated(replica.url, prompt, c), temperature, stop) for c in choices]
        if self.partial_rollouts:
            args = (temperature, max_tokens, server_stop)
            eos, retries = self.eos_token_id, self.max_retries
            parts = await stream_completions(
                self.router, self._streams, prompt, args, n, deadline, eos_id=eos, max_retries=retries
            )
            return [
                self._cut(
                    prompt,
                    p.tokens,
                    p.logprobs,
                    p.text if p.requests == 1 else None,
                    p.stop_reason,
                    temperature,
                    stop,
                    p.versions,
                )
                for p in parts
            ]
        body = completion_request(prompt, temperature, max_tokens, server_stop)
        replica, choices = await self.router.complete(body, n, deadline)
        return [self._cut(prompt, *read_completion(replica.url, prompt, c), temperature, stop) for c in choices]

    def _cut(
        self,
        prompt: list[int],
        tokens: list[int],
        logprobs: list[float],
        text: Optional[str],
        stop_reason: Optional[str],
        temperature: float,
        stop: tuple[str, ...],
        versions: Optional[list[int]] = None,
    ) -> Completion:
        """The completion of `tokens`. It is cut here, by the servers' rule (`stops.find_stop`),
        where the server did not see the stop strings (more than it takes) or not the whole text
        (`text` None: a completion a weight sync interrupted, continued by a second request)."""
        if len(stop) > MAX_SERVER_STOPS or text is None:
            eos_id = self.eos_token_id
            end = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
            match = find_stop(tokens[:end], stop, self._decode) if stop else None
            if match is not None:
                tokens, text, stop_reason = tokens[: match.num_tokens], match.text, match.stop
            elif text is None:
                text, stop_reason = self._decode(tokens[:end]), None
        raw_known = temperature in (0.0, 1.0)  # processed logprobs == raw ones there (see the module docstring)
        return self.completion(
            prompt,
            tokens,
            list(logprobs),
            text,
            stop_reason=stop_reason,
            inference_logprobs=list(logprobs) if raw_known else None,
            token_versions=versions,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ end

    def _cancel_running(self) -> None:
        """Cancel every request in flight on the client's loop (the run is ending): each closes its
        HTTP request or stream, and the server aborts a request whose client went away. Bounded:
        the cancelled requests get CANCEL_WAIT_S to unwind."""
        if self._closed or not self._loop.is_running():
            return

        async def cancel_requests() -> None:
            running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running, timeout=CANCEL_WAIT_S)

        try:
            asyncio.run_coroutine_threadsafe(cancel_requests(), self._loop).result(CANCEL_WAIT_S + 1.0)
        except Exception:  # a request that would not unwind must not keep the run from ending
            log.debug("cancelling the requests in flight failed", exc_info=True)

    def close(self) -> None:
        """Close the HTTP client and stop the servers this sampler started. Idempotent."""
        if self._closed:
            return
        if self.pool is None and self.max_loras and self._loop.is_running():
            self.release_adapters()  # servers shared with other runs: this run's adapters are its own to unload
        self._closed = True
        try:
            if self._loop.is_running() and getattr(self, "_client", None) is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(5.0)
                except Exception:  # a stuck connection must not keep the servers alive
                    log.debug("closing the HTTP client failed", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if join_thread(self._thread, 5.0, "the vLLM server client's event loop"):
                self._loop.close()
        finally:
            if self.transport is not None:
                self.transport.close()
            if self.pool is not None:
                self.pool.stop()
            super().close()
