"""What every sampler shares: request batching, sampling-argument checks, chat templating, weight names."""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from transformers import PreTrainedTokenizerBase

from lit_grpo.types import Completion

# Prefixes Lightning and torch wrappers put in front of the policy's parameter names.
_WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.", "policy.")


def check_sample_kwargs(kwargs: dict[str, Any]) -> tuple[float, int]:
    """Validate sampling kwargs and return (temperature, max_tokens); temperature 0 is greedy decoding.

    Only untruncated sampling is offered: top_p < 1 or top_k > 0 would make the reported
    logprobs differ from the distribution the trainer's ratio assumes.
    """
    unknown = set(kwargs) - {"temperature", "max_tokens", "top_p", "top_k"}
    if unknown:
        raise ValueError(f"unknown sampling arguments {sorted(unknown)}; valid: temperature, max_tokens, top_p, top_k")
    if kwargs.get("top_p", 1.0) != 1.0 or kwargs.get("top_k", 0) not in (0, -1, None):
        raise ValueError("samplers only support top_p=1.0 and top_k=0: truncated sampling biases the logprobs")
    temperature = float(kwargs.get("temperature", 1.0))
    max_tokens = int(kwargs.get("max_tokens", 16))
    if temperature < 0 or max_tokens <= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy) and max_tokens > 0, got {temperature}, {max_tokens}")
    return temperature, max_tokens


def chat_prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the policy's chat template, ending with the assistant cue."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


@dataclass
class _Request:
    prompt: list[int]
    temperature: float
    max_tokens: int
    future: asyncio.Future


class BatchingSampler(ABC):
    """The `Sampler` protocol on top of one batched `_generate(prompts, temperature, max_tokens)`.

    Rollout functions ask for one trajectory at a time (`n=1`); concurrent requests that arrive
    in the same event-loop tick are gathered into one batched call, run on a worker thread so
    the event loop (tool calls, other rollouts) keeps going while the engine generates. A weight
    sync never lands in the middle of a batch. Subclasses implement `_generate` and `_load`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, max_batch_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._queue: list[_Request] = []
        self._flushing: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")
        self._weights_lock = threading.Lock()

    async def sample_with_prompt_tokens(self, prompt_token_ids: list[int], n: int = 1, **kwargs: Any) -> list[Completion]:
        temperature, max_tokens = check_sample_kwargs(kwargs)
        loop = asyncio.get_running_loop()
        futures = []
        for _ in range(n):
            fut = loop.create_future()
            self._queue.append(_Request(list(prompt_token_ids), temperature, max_tokens, fut))
            futures.append(fut)
        if loop not in self._flushing:
            self._flushing[loop] = loop.create_task(self._flush(loop))
        return list(await asyncio.gather(*futures))

    async def sample_with_tokens(self, messages: list[dict], n: int = 1, **kwargs: Any) -> list[Completion]:
        return await self.sample_with_prompt_tokens(chat_prompt_tokens(self.tokenizer, messages), n, **kwargs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._weights_lock:
            self._load(named_tensors)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Generate for everything queued, in batches, until the queue is empty."""
        try:
            await asyncio.sleep(0)  # let every rollout started in this tick enqueue first
            while self._queue:
                head = self._queue[0]
                same = [r for r in self._queue if (r.temperature, r.max_tokens) == (head.temperature, head.max_tokens)]
                batch = same[: self.max_batch_size]
                taken = set(map(id, batch))
                self._queue = [r for r in self._queue if id(r) not in taken]
                try:
                    completions = await loop.run_in_executor(
                        self._worker, self.generate, [r.prompt for r in batch], head.temperature, head.max_tokens
                    )
                except Exception as err:  # every waiting rollout sees the failure
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(err)
                    continue
                for r, c in zip(batch, completions):
                    if not r.future.done():
                        r.future.set_result(c)
        finally:
            self._flushing.pop(loop, None)

    def generate(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        """One batched call. Returns one `Completion` per prompt."""
        with self._weights_lock:
            return self._generate(prompts, temperature, max_tokens)

    @abstractmethod
    def _generate(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        """Sample one completion per prompt (the engine's batched call)."""

    @abstractmethod
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's weights into the engine."""

    def completion(self, prompt: list[int], generated: list[int], logprobs: list[float], text: str) -> Completion:
        """A `Completion` of `generated`, cut after the first eos."""
        eos_id = self.tokenizer.eos_token_id
        stop = generated.index(eos_id) + 1 if eos_id in generated else len(generated)
        return Completion(
            full_tokens=list(prompt) + generated[:stop],
            prompt_len=len(prompt),
            inference_logprobs=list(logprobs[:stop]),
            finish_reason="stop" if eos_id in generated[:stop] else "length",
            text=text,
        )
