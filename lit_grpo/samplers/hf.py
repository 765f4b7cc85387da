"""The transformers sampler: batched `generate` with a KV cache, on the sampler's own copy of the weights.

Rollout functions ask for one trajectory at a time (`n=1`); concurrent requests that arrive in
the same event-loop tick are gathered into one batched `generate` call, run on a worker thread
so the event loop (tool calls, other rollouts) keeps going while the model generates.
Logprobs are those of the sampling distribution: `log_softmax(logits / temperature)` with
top_p=1 and top_k=0, so they can serve as the behaviour policy in TIS.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.samplers.base import chat_prompt_tokens, check_sample_kwargs, normalize_weight_name
from lit_grpo.types import Completion


@dataclass
class _Request:
    prompt: list[int]
    temperature: float
    max_tokens: int
    future: asyncio.Future


class HFSampler:
    """Implements the `Sampler` protocol with `model.generate` on a private copy of the policy."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, max_batch_size: int = 256) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._queue: list[_Request] = []
        self._flushing: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-sampler")
        self._weights_lock = threading.Lock()  # a sync never lands in the middle of a generate call
        self.generated_tokens = 0
        """Tokens generated so far (for throughput metrics)."""

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

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._weights_lock:
            self._load(named_tensors)

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        seen = set()
        for name, tensor in named_tensors:
            key = normalize_weight_name(name, params)
            params[key].copy_(tensor.detach().to(params[key].device, params[key].dtype))
            seen.add(key)
        missing = set(params) - seen
        if missing:
            raise RuntimeError(f"weight sync left {len(missing)} sampler parameters stale, e.g. {sorted(missing)[:3]}")

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
        """One batched, left-padded `generate` call. Returns one `Completion` per prompt."""
        with self._weights_lock:
            return self._generate(prompts, temperature, max_tokens)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        device = next(self.model.parameters()).device
        pad_id, eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        gen_config = GenerationConfig(
            do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
            eos_token_id=eos_id, pad_token_id=pad_id, output_logits=True, return_dict_in_generate=True,
        )
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_config)
        new_tokens_NS = out.sequences[:, width:].cpu()
        logits_NSV = torch.stack(out.logits, dim=1).float()
        logprobs_NS = torch.log_softmax(logits_NSV / temperature, dim=-1).gather(-1, new_tokens_NS.to(logits_NSV.device)[..., None])[..., 0].cpu()
        rows = new_tokens_NS.tolist()
        stops = [row.index(eos_id) + 1 if eos_id in row else len(row) for row in rows]
        generated = [row[:stop] for row, stop in zip(rows, stops)]
        texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        logprobs = logprobs_NS.tolist()
        self.generated_tokens += sum(stops)
        completions = [
            Completion(
                full_tokens=list(p) + gen,
                prompt_len=len(p),
                inference_logprobs=lp[:stop],
                finish_reason="stop" if gen and gen[-1] == eos_id else "length",
                text=text,
            )
            for p, gen, stop, lp, text in zip(prompts, generated, stops, logprobs, texts)
        ]
        return completions
