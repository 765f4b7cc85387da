"""What every sampler shares: request batching, weight names, and the bounds on a sampler call
(a deadline, the longest prompt). The call's arguments and errors are `lit_grpo.samplers.arguments`."""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import PreTrainedTokenizerBase

from lit_grpo.samplers.arguments import (
    PromptTooLong,
    SamplerClosed,
    SamplerTimeout,
    ScorePair,
    chat_prompt_tokens,
    check_sample_kwargs,
    check_score_pairs,
)
from lit_grpo.samplers.worker import DaemonWorker
from lit_grpo.types import Completion

# Prefixes Lightning and torch wrappers put in front of the policy's parameter names.
_WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.", "policy.")


def strip_wrapper_prefixes(name: str) -> str:
    """A policy parameter name without the prefixes Lightning/DDP/compile wrappers add."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def normalize_weight_name(name: str, known: dict) -> str:
    """Map a policy parameter name (possibly wrapped) onto one of the sampler's `known` names."""
    key = name if name in known else strip_wrapper_prefixes(name)
    if key not in known:
        raise KeyError(f"policy weight {name!r} has no counterpart in the sampler")
    return key


CLOSE_WAIT_S = 10.0
"""How long closing a sampler waits for an engine call still running."""


def _raise(err: BaseException) -> None:
    raise err


@dataclass
class _Request:
    prompt: list[int]
    n: int
    temperature: float
    max_tokens: int
    stop: tuple[str, ...]
    future: asyncio.Future
    """Set to the request's n completions: one future per request, not one per completion."""
    multi_modal: Optional[dict[str, torch.Tensor]] = None
    """The prompt's images as the policy's forward takes them (`RolloutSample.multi_modal`); None: text."""

    @property
    def key(self) -> tuple:
        """Requests with equal keys can share one batched generate call."""
        return self.temperature, self.max_tokens, self.stop


class BatchingSampler(ABC):
    """The `Sampler` protocol on top of one batched `_generate(prompts, temperature, max_tokens[, stop])`.

    Rollout functions ask for one trajectory at a time (`n=1`); concurrent requests that arrive
    in the same event-loop tick with the same temperature, max_tokens (after the request's
    `max_seq_len` bound) and stop strings are gathered into one batched call, run on a worker
    thread so the event loop (tool calls, other rollouts) keeps going while the engine generates
    (or on the loop's own thread, `engine_on_loop`).
    A weight sync never lands in the middle of a batch. Subclasses implement `_generate` and `_load`.

    The rollout data module sets the bounds (`bound_calls`): `call_timeout_s` (the rollout
    deadline), `max_seq_len` (`data.max_seq_len`) and `engine_on_loop`.
    """

    group_requests = True
    """A request for n completions is one batched engine call, which succeeds or fails whole."""

    takes_images = False
    """Whether `sample_with_prompt_tokens` takes a prompt's images (`multi_modal`): the engine's
    `_generate` then takes `multi_modal=` too. A sampler that does not refuses images by name."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, max_batch_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        """Looked up once: a transformers tokenizer resolves it through the vocabulary at each access."""
        self.max_batch_size = max_batch_size
        self.image_token_ids: frozenset[int] = frozenset()
        """A vision-language policy's image placeholder ids (set by the run from its processor):
        `score`, which takes no images, refuses pairs that hold them."""
        self.cancelled = threading.Event()
        """Set by `cancel` (the run's end): engine calls end early and new ones are refused."""
        self.call_timeout_s: Optional[float] = None
        """A batched generate that takes longer fails its requests with `SamplerTimeout` (None: no bound)."""
        self.max_seq_len: Optional[int] = None
        """A prompt of this many tokens or more is refused with `PromptTooLong`, and a completion
        stops when prompt + completion reach it (None: no bound)."""
        self.engine_on_loop = False
        """True: the batched engine calls run on the event loop's own thread (`sampler.engine_thread:
        loop`), blocking the loop for each call; no `call_timeout_s` bound then (the loop's
        heartbeat is the deadline: a training run's watchdog stops a call that outlives it)."""
        self._queue: list[_Request] = []
        self._flushing: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self._worker = DaemonWorker("sampler")
        self._weights_lock: threading.Lock | threading.RLock = threading.Lock()
        self._score_queues: dict[asyncio.AbstractEventLoop, list[tuple[list[ScorePair], asyncio.Future]]] = {}
        self._score_tasks: set[asyncio.Task] = set()

    async def sample_with_prompt_tokens(
        self,
        prompt_token_ids: list[int],
        n: int = 1,
        *,
        multi_modal: Optional[dict[str, torch.Tensor]] = None,
        **kwargs: Any,
    ) -> list[Completion]:
        """`n` completions of a tokenized prompt (with `multi_modal`, the images its placeholder
        tokens stand for, for a sampler that `takes_images`); `kwargs` are the sampling arguments of
        `check_sample_kwargs` (temperature, max_tokens, top_p, top_k, stop, logprobs, max_seq_len,
        http_timeout). `http_timeout` is a deadline on the wait for this request only: the
        in-process engine call it joined cannot be cancelled and the other requests of that call
        get their completions; a request still queued when its deadline passes is never generated."""
        args = check_sample_kwargs(kwargs)
        if multi_modal and not self.takes_images:
            raise ValueError(
                f"{type(self).__name__} cannot sample a prompt with images (multi_modal): "
                "only sampler.kind=hf takes them so far"
            )
        prompt_len = len(prompt_token_ids)
        if self.max_seq_len is not None and prompt_len >= self.max_seq_len:
            raise PromptTooLong(
                f"a prompt of {prompt_len} tokens leaves no room for a completion within "
                f"data.max_seq_len={self.max_seq_len}; it was not sampled"
            )
        # Generating past data.max_seq_len would only make a sample that is dropped as too long:
        # the completion stops there instead (finish_reason "length").
        max_tokens = (
            args.max_tokens if self.max_seq_len is None else min(args.max_tokens, self.max_seq_len - prompt_len)
        )
        if args.max_seq_len is not None:
            if prompt_len >= args.max_seq_len:
                raise PromptTooLong(
                    f"a prompt of {prompt_len} tokens leaves no room for a completion within "
                    f"the request's max_seq_len={args.max_seq_len}; it was not sampled"
                )
            max_tokens = min(max_tokens, args.max_seq_len - prompt_len)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        images = multi_modal or None
        self._queue.append(_Request(list(prompt_token_ids), n, args.temperature, max_tokens, args.stop, future, images))
        if loop not in self._flushing:
            self._flushing[loop] = loop.create_task(self._flush(loop))
        if args.http_timeout is None:
            return await future  # a cancelled caller cancels the future: the flush skips a request still queued
        try:
            done, _ = await asyncio.wait({future}, timeout=args.http_timeout)
        finally:
            if not future.done():  # timed out, or this caller was cancelled: the flush skips what is still queued
                future.cancel()
        if not done:
            raise SamplerTimeout(
                f"no completion within http_timeout={args.http_timeout:g} s: the request's batched "
                "generate call is still running or queued (an in-process engine call cannot be "
                "cancelled; this request was dropped, the others of its call are unaffected)"
            )
        return future.result()

    async def sample_with_tokens(self, messages: list[dict], n: int = 1, **kwargs: Any) -> list[Completion]:
        return await self.sample_with_prompt_tokens(chat_prompt_tokens(self.tokenizer, messages), n, **kwargs)

    async def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Per (prompt, target) pair, the policy's logprob of each target token given the prompt and
        the target tokens before it, at temperature 1 (IGPO's answer scores). Concurrent calls from
        one event-loop tick are scored in one batched engine call on the worker thread, never
        during a weight sync; waited for at most `call_timeout_s`. Shapes: [N] pairs -> [N][len(target)]."""
        checked = check_score_pairs(pairs, self.image_token_ids)
        if not checked:
            return []
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        queue_ = self._score_queues.setdefault(loop, [])
        queue_.append((checked, future))
        if len(queue_) == 1:  # the first of this tick: schedule the flush (kept referenced until it ends)
            task = loop.create_task(self._flush_scores(loop))
            self._score_tasks.add(task)
            task.add_done_callback(self._score_tasks.discard)
        return await future

    async def _flush_scores(self, loop: asyncio.AbstractEventLoop) -> None:
        await asyncio.sleep(0)  # let every rollout of this tick add its pairs first
        waiting = [(pairs, f) for pairs, f in self._score_queues.pop(loop, []) if not f.done()]
        if not waiting:
            return
        flat = [pair for pairs, _ in waiting for pair in pairs]
        call = self._engine_call(loop, self.score_pairs, flat)
        done, _ = await asyncio.wait({call}, timeout=self.call_timeout_s)
        if not done:
            call.add_done_callback(lambda f: f.cancelled() or f.exception())  # its late outcome is nobody's to log
        error = (
            None
            if done and call.exception() is None
            else (
                call.exception()
                or SamplerTimeout(
                    f"the sampler's batched score of {len(flat)} pairs did not return within {self.call_timeout_s} s "
                    "(guards.rollout_timeout_s)"
                )
            )
        )
        offset = 0
        for pairs, f in waiting:
            if f.done():
                pass
            elif error is not None:
                f.set_exception(error)
            else:
                f.set_result(call.result()[offset : offset + len(pairs)])
            offset += len(pairs)

    def score_pairs(self, pairs: list[ScorePair]) -> list[list[float]]:
        """`score`'s synchronous batched call (on any thread): never during a weight sync."""
        with self._weights_lock:
            out: list[list[float]] = []
            for start in range(0, len(pairs), self.max_batch_size):
                self._refuse_if_cancelled()
                out += self._score(pairs[start : start + self.max_batch_size])
            return out

    def _score(self, pairs: list[ScorePair]) -> list[list[float]]:
        """The engine's batched scoring of (prompt, target) pairs (see `score`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score target tokens")

    def bound_calls(self, timeout_s: Optional[float], max_seq_len: Optional[int], engine_on_loop: bool) -> None:
        """Set `call_timeout_s`, `max_seq_len` and `engine_on_loop` (see their docstrings)."""
        self.call_timeout_s, self.max_seq_len, self.engine_on_loop = timeout_s, max_seq_len, engine_on_loop

    def to_device(self, device: torch.device) -> None:  # noqa: B027 (a default, not abstract)
        """Nothing to move by default: an engine that runs on the trainer's device overrides it."""

    def sleep(self) -> None:  # noqa: B027 (a default, not abstract)
        """Nothing to free by default: an engine that can release its memory between steps overrides it."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the weights between two generate calls; waiting for a running call is bounded by
        `call_timeout_s` (a stuck engine would otherwise hold the sync, and training, forever)."""
        self._between_calls(self._load, named_tensors)

    def _between_calls(self, load: Any, *args: Any) -> None:
        """`load(*args)` while no engine call runs (the wait bounded by `call_timeout_s`)."""
        if not self._weights_lock.acquire(timeout=-1 if self.call_timeout_s is None else self.call_timeout_s):
            raise SamplerTimeout(
                f"the weight sync waited {self.call_timeout_s:g} s (guards.rollout_timeout_s) for the sampler's "
                "running generate call to end: the engine looks stuck"
            )
        try:
            load(*args)
        finally:
            self._weights_lock.release()

    def cancel(self) -> None:
        """Stop generating, from any thread: a running engine call ends at its next step
        (`_cancel_running`) and raises `SamplerClosed`, as does every call from now on. The run's end
        calls it first, so nothing it then joins waits for a completion nobody will train on."""
        self.cancelled.set()
        self._cancel_running()

    def _cancel_running(self) -> None:  # noqa: B027 (a default, not abstract)
        """End the engine call now running at its next step (an engine that can stop one overrides
        it; the flag `cancelled` is set already). By default it runs to its end."""

    def _refuse_if_cancelled(self, call_cut_short: bool = False) -> None:
        if self.cancelled.is_set():
            raise SamplerClosed(
                "the sampler was cancelled (the run is ending): "
                + ("this engine call was cut short" if call_cut_short else "no more engine calls")
            )

    def close(self) -> None:
        """Cancel (`cancel`), drop queued calls and join the worker, for at most CLOSE_WAIT_S (an engine
        call that cannot be stopped is left to its daemon thread rather than keeping the process alive)."""
        self.cancel()
        self._worker.close(CLOSE_WAIT_S)

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Generate for everything queued, in batches, until the queue is empty."""
        try:
            await asyncio.sleep(0)  # let every rollout started in this tick enqueue first
            while True:
                self._queue = [r for r in self._queue if not r.future.done()]  # past their http_timeout: not generated
                if not self._queue:
                    break
                head = self._queue[0]
                batch = self._next_batch(head)
                taken = set(map(id, batch))
                self._queue = [r for r in self._queue if id(r) not in taken]
                prompts = [r.prompt for r in batch for _ in range(r.n)]
                images = [r.multi_modal for r in batch for _ in range(r.n)]
                try:
                    completions = await self._bounded(
                        self._engine_call(loop, self._generate_all, prompts, head, images), len(prompts)
                    )
                except Exception as err:  # every waiting rollout sees the failure
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(err)
                    continue
                offset = 0
                for r in batch:
                    if not r.future.done():
                        r.future.set_result(completions[offset : offset + r.n])
                    offset += r.n
        finally:
            self._flushing.pop(loop, None)

    def _next_batch(self, head: _Request) -> list[_Request]:
        """The queued requests with `head`'s key, in order, up to `max_batch_size` prompts in all
        (`head` alone when its n is more: `_generate_all` splits it)."""
        batch: list[_Request] = []
        size = 0
        for r in self._queue:
            if r.key == head.key:
                if batch and size + r.n > self.max_batch_size:
                    break
                batch.append(r)
                size += r.n
        return batch

    def _generate_all(
        self, prompts: list[list[int]], head: _Request, images: Optional[list[Optional[dict]]] = None
    ) -> list[Completion]:
        """`generate` over `prompts` with `head`'s arguments, in calls of at most `max_batch_size`.
        The stop strings are passed only when set: an engine without them keeps the 3-argument
        `_generate`; the images (one entry per prompt, None: text) only when a prompt has some."""
        extra = (head.stop,) if head.stop else ()
        with_images = images is not None and any(images)
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = slice(start, start + self.max_batch_size)
            more: dict[str, Any] = {"multi_modal": images[chunk]} if with_images and images is not None else {}
            out += self.generate(prompts[chunk], head.temperature, head.max_tokens, *extra, **more)
        return out

    def _engine_call(self, loop: asyncio.AbstractEventLoop, fn, *args: Any) -> asyncio.Future:
        """`fn(*args)` on the worker thread, or, with `engine_on_loop`, here and now on the loop's
        thread: on a CPU, a second thread would run its own torch thread pool, and the two pools
        spin against each other (and against the trainer's, between steps)."""
        if not self.engine_on_loop:
            return loop.run_in_executor(self._worker, fn, *args)
        done = loop.create_future()
        try:
            done.set_result(fn(*args))
        except (KeyboardInterrupt, SystemExit) as stop:
            # A stop signal's exception is raised out of the loop itself, as when the signal lands
            # while the loop waits: a task ended by it would be reported again, at exit, as an
            # exception nobody retrieved. The call's requests stay pending, as on the worker.
            loop.call_soon(_raise, stop)
        except Exception as err:
            done.set_exception(err)
        return done

    async def _bounded(self, call: asyncio.Future, num_prompts: int) -> list[Completion]:
        """The result of a generate call on the worker, waited for at most `call_timeout_s`. The
        engine call itself cannot be cancelled: later calls queue behind it and time out too, so a
        stuck engine shows as failing rollouts and the circuit breaker stops the run."""
        done, _ = await asyncio.wait({call}, timeout=self.call_timeout_s)
        if not done:
            call.add_done_callback(lambda f: f.cancelled() or f.exception())  # its late outcome is nobody's to log
            raise SamplerTimeout(
                f"the sampler's batched generate of {num_prompts} prompts did not return within "
                f"{self.call_timeout_s:g} s (guards.rollout_timeout_s): the engine looks stuck"
            )
        return call.result()

    def generate(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        multi_modal: Optional[list[Optional[dict[str, torch.Tensor]]]] = None,
    ) -> list[Completion]:
        """One batched call. Returns one `Completion` per prompt; `SamplerClosed` once cancelled
        (a call that `cancel` cut short included: its completions would be partial). `multi_modal`:
        each prompt's images (None: text), for a sampler that `takes_images`."""
        more: dict[str, Any] = {"stop": tuple(stop)} if stop else {}
        if multi_modal is not None and any(multi_modal):
            if not self.takes_images:
                raise ValueError(f"{type(self).__name__} cannot sample a prompt with images (multi_modal)")
            more["multi_modal"] = list(multi_modal)
        with self._weights_lock:
            self._refuse_if_cancelled()
            completions = self._generate(prompts, temperature, max_tokens, **more)
        self._refuse_if_cancelled(call_cut_short=True)
        return completions

    @abstractmethod
    def _generate(
        self, prompts: list[list[int]], temperature: float, max_tokens: int, stop: tuple[str, ...] = ()
    ) -> list[Completion]:
        """Sample one completion per prompt (the engine's batched call), each ended at the first of
        the `stop` strings it completes (see `lit_grpo.samplers.stops`). `stop` is passed only
        when set: an engine that cannot honour stop strings may leave it out of its signature."""

    @abstractmethod
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's weights into the engine."""

    def completion(
        self,
        prompt: list[int],
        generated: list[int],
        logprobs: list[float],
        text: str,
        *,
        inference_logprobs: Optional[list[float]] = None,
        stop_reason: Optional[str] = None,
        token_versions: Optional[list[int]] = None,
    ) -> Completion:
        """A `Completion` of `generated`, cut after the first eos. `stop_reason`: the stop string
        `generated` already ends at (its completing token included) and `text` is already cut before.
        `token_versions`: parallel to `generated`, the weight version of each token (None: not known)."""
        eos_id = self.eos_token_id
        end = generated.index(eos_id) + 1 if eos_id in generated else len(generated)
        stopped = stop_reason is not None or eos_id in generated[:end]
        return Completion(
            full_tokens=list(prompt) + generated[:end],
            prompt_len=len(prompt),
            sampling_logprobs=list(logprobs[:end]),
            finish_reason="stop" if stopped else "length",
            text=text,
            inference_logprobs=None if inference_logprobs is None else list(inference_logprobs[:end]),
            stop_reason=stop_reason,
            token_versions=None if token_versions is None else list(token_versions[:end]),
        )
