"""The default rollout function: one completion per call, scored by the configured reward.

A user's own `make_rollout_fn(setup)` replaces this one (multi-turn, tools, retries); it only has
to return a `RolloutSample` (or None to drop the sample) per call. The default one reads the row as
stored: its prompt is token ids, chat messages or text (`row_prompt_tokens`), its reward the
run's `reward_fn(completion_text, row)`. Each call is bounded by
`guards.rollout_timeout_s`; a prompt (token ids or a templated chat) that leaves no room for a completion
within `data.max_seq_len` is refused by the sampler with `PromptTooLong` before it reaches the
engine, and the sample is counted as `rollout/dropped_prompt_too_long`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Optional

from lit_grpo.rollouts.deadlines import MAX_BACKOFF_S, RETRY_BACKOFF_S, TRANSIENT_ERRORS, classify, function_name
from lit_grpo.samplers.arguments import chat_prompt_tokens
from lit_grpo.tasks.images import (
    PlaceholderInCompletion,
    RowImageError,
    image_placeholder_ids,
    messages_have_images,
    row_has_images,
    row_images,
    vision_prompt,
)
from lit_grpo.tasks.rows import RowPromptError, bad_prompt_message, prompt_field_of, row_label
from lit_grpo.types import Completion, RolloutSample, RolloutSetup

RolloutFn = Callable[[dict], Awaitable[Optional[RolloutSample]]]


def load_rollout_factory(path: str) -> Callable[[RolloutSetup], RolloutFn]:
    """Import `module:function` (the working directory is importable) and return the factory;
    `ConfigError` naming `rollout.factory` and what went wrong (file and line of an import error)."""
    from lit_grpo.config import ConfigError
    from lit_grpo.errors import UserError, import_user_object

    try:
        factory = import_user_object(path, "rollout.factory")
    except UserError as err:
        raise ConfigError(str(err)) from err.__cause__
    if not callable(factory):
        raise ConfigError(f"config field `rollout.factory`: {path!r} is not callable")
    return factory


def is_async_callable(fn: Callable) -> bool:
    """Whether calling `fn` makes a coroutine, by its definition: an `async def` function or method,
    a `functools.partial` of one, an object whose `__call__` is one, or a decorator's wrapper of one
    (`functools.wraps` records what it wraps, and such a wrapper returns the coroutine)."""
    return any(
        inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__)
        for f in (fn, inspect.unwrap(fn))
    )


def built_rollout_fn(factory: Callable[[RolloutSetup], RolloutFn], setup: RolloutSetup, name: str) -> RolloutFn:
    """`factory(setup)`, checked: a factory that returns something other than a rollout function
    (a forgotten `return`), or a plain `def` one (each call is awaited under its deadline), is
    named here, not at the first rollout."""
    from lit_grpo.config import ConfigError

    rollout_fn = factory(setup)
    if not callable(rollout_fn):
        raise ConfigError(
            f"config field `rollout.factory`: {name} returned {type(rollout_fn).__name__} {rollout_fn!r:.60}, "
            "not a rollout function; it must return `async def rollout_fn(row)` (did it forget a `return`?)"
        )
    group_fn = group_rollout_fn(rollout_fn)
    for fn, signature in ((rollout_fn, "rollout_fn(row)"), (group_fn, f"{GROUP_ATTRIBUTE}(row, n)")):
        if fn is not None and not is_async_callable(fn):
            raise ConfigError(
                f"config field `rollout.factory`: {name} returned {function_name(fn)}, a plain function; "
                f"it must be `async def {signature}` (the trainer awaits each call under guards.rollout_timeout_s)"
            )
    return rollout_fn


def sample_from_completion(c: Completion, reward: float) -> RolloutSample:
    """Flatten a single-turn completion: prompt tokens masked out, generated tokens trained on."""
    generated = len(c.full_tokens) - c.prompt_len
    return RolloutSample(
        tokens=list(c.full_tokens),
        logprobs=[0.0] * c.prompt_len + list(c.sampling_logprobs),
        loss_mask=[0] * c.prompt_len + [1] * generated,
        reward=float(reward),
        finish_reason=c.finish_reason,
        text=c.text,
        token_versions=None if c.token_versions is None else [-1] * c.prompt_len + list(c.token_versions),
    )


PROMPT_CACHE_SIZE = 1 << 16
"""Plain-text prompts whose token ids a rollout function keeps (each row is sampled G times)."""


def text_prompt_tokens(tokenizer, text: str) -> list[int]:
    """A plain-text prompt tokenized as generation in transformers and TRL does it: `tokenizer(text)`,
    with the tokenizer's special tokens (a BOS for the models that use one)."""
    return tokenizer(text)["input_ids"]


def _prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages without the assistant turns at the end (a reference answer is not a prompt)."""
    end = len(messages)
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "assistant":
        end -= 1
    return messages[:end]


def row_prompt_tokens(
    row: dict,
    tokenizer,
    prompt_field: Optional[str] = None,
    *,
    text_tokens: Optional[Callable[[str], Sequence[int]]] = None,
) -> list[int]:
    """A row's prompt as token ids, from `prompt_field` or the first of `prompt_token_ids`,
    `messages`, `prompt` the row has (`lit_grpo.tasks.rows.prompt_field_of`), by the field's value:
    token ids as they are; chat messages (minus assistant turns at the end) through the chat
    template; text through `text_tokens` (default `text_prompt_tokens`, special tokens included).
    `RowPromptError` (a `UserError` that stops training at once) names the row when none fits."""
    field = prompt_field_of(row, prompt_field)
    value = row[field]
    if isinstance(value, str):
        return list(text_tokens(value)) if text_tokens is not None else text_prompt_tokens(tokenizer, value)
    if isinstance(value, (list, tuple)) and value:  # by the first item: the sampler checks every token id
        if isinstance(value[0], int) and not isinstance(value[0], bool):
            return list(value)
        if isinstance(value[0], dict):
            if messages_have_images(value):  # a text policy would read the placeholders blind
                raise RowPromptError(
                    f"row {row_label(row)}: its messages hold images, which only a vision-language policy "
                    "takes (model.kind=tiny_vlm), through the default rollout"
                )
            return chat_prompt_tokens(tokenizer, _prompt_messages(list(value)))
    raise RowPromptError(bad_prompt_message(row, field))


def row_prompt(
    row: dict,
    tokenizer,
    processor=None,
    prompt_field: Optional[str] = None,
    *,
    text_tokens: Optional[Callable[[str], Sequence[int]]] = None,
) -> tuple[list[int], Optional[dict]]:
    """A row's prompt token ids and, for a vision-language policy (`processor`) and a row with
    images (`lit_grpo.tasks.images`), the image tensors its forward takes (else None):
    `row_prompt_tokens` for text. `RowImageError` for images that cannot be used."""
    if processor is not None:
        messages = row.get(prompt_field or "messages")
        if isinstance(messages, list) and row_has_images(row, messages):
            messages = _prompt_messages(messages)
            return vision_prompt(processor, messages, row_images(row, messages))
    tokens = row_prompt_tokens(row, tokenizer, prompt_field, text_tokens=text_tokens)
    if processor is not None and image_placeholder_ids(processor).intersection(tokens):  # a text row of a VLM
        raise RowImageError("its prompt holds an image placeholder token but the row has no image")
    return tokens, None


GROUP_ATTRIBUTE = "sample_group"
"""A rollout function may carry `sample_group(row, n) -> list of n results` (a `RolloutSample` or
None each): the same samples as n calls of it, from one sampler request. The trainer then makes
one call per row instead of G, with one deadline and one retry budget for the whole group (a
failure or a timeout counts for each of its G samples). The default rollout has one for the
in-process samplers, whose batched engine call fails or returns as a whole anyway."""


def group_rollout_fn(
    rollout_fn: RolloutFn,
) -> Optional[Callable[..., Awaitable[list[Optional[RolloutSample] | BaseException]]]]:
    """The rollout function's `sample_group(row, n)`, if it has one (see GROUP_ATTRIBUTE)."""
    return getattr(rollout_fn, GROUP_ATTRIBUTE, None)


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    """One completion of the row's prompt (`row_prompt_tokens`, with `setup.extras["prompt_field"]`),
    scored by the run's reward (`lit_grpo.rewards.scoring`: async or not, under its limit and deadline);
    a None reward drops the sample. A weighted reward's components go in the sample's `metrics`
    (`reward/<name>`), and so does `reward/timed_out`. With an in-process sampler it also
    samples a whole group in one request (`sample_group`, see GROUP_ATTRIBUTE)."""
    from lit_grpo.rewards import reward_scorer

    sampler, tokenizer, sample_kwargs = setup.sampler, setup.tokenizer, dict(setup.sample_kwargs)
    scorer = reward_scorer(setup.extras)
    prompt_field = setup.extras.get("prompt_field")
    # The G calls of a row tokenize the same text: once is enough (~40 µs a call on the demo's tokenizer).
    cached_text_tokens = functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)(
        lambda text: tuple(text_prompt_tokens(tokenizer, text))
    )

    retry_on = tuple(setup.extras.get("retry_on", TRANSIENT_ERRORS))
    max_retries = int(setup.extras.get("max_retries", 2))

    processor = setup.processor
    # A generated image placeholder would stand for an image the row does not have: the forward
    # would refuse the sequence (placeholders and image features must match), so its sample is
    # dropped, for a row with images and a text row alike (both batch together in a VLM's forward).
    placeholders = image_placeholder_ids(processor)

    def prompt_of(row: dict) -> tuple[list[int], Optional[dict]]:
        return row_prompt(row, tokenizer, processor, prompt_field, text_tokens=cached_text_tokens)

    async def sample(prompt: list[int], n: int, images: Optional[dict]) -> list[Completion]:
        more = {"multi_modal": images} if images else {}  # a text prompt calls every sampler as before
        return await sampler.sample_with_prompt_tokens(prompt, n=n, **more, **sample_kwargs)

    async def scored(c: Completion, row: dict, images: Optional[dict] = None) -> Optional[RolloutSample]:
        # A reward error of `retry_on` is retried here, for this sample alone (the completion is kept).
        for attempt in range(max_retries + 1):
            try:
                result = await scorer.score(c.text, row)
                break
            except Exception as err:
                if attempt == max_retries or classify(err, retry_on) != "transient":
                    raise
                await asyncio.sleep(min(RETRY_BACKOFF_S * 2**attempt, MAX_BACKOFF_S))
        if result.value is None:  # not applicable to this row: counted as rollout/dropped_none
            return None
        if placeholders and placeholders.intersection(c.full_tokens[c.prompt_len :]):
            raise PlaceholderInCompletion("the completion holds an image placeholder token, which stands for no image")
        sample = sample_from_completion(c, result.value)
        sample.multi_modal = images
        sample.metrics.update(result.metrics)
        sample.metrics["reward/retries"] = float(attempt)
        return sample

    async def rollout_fn(row: dict) -> Optional[RolloutSample]:
        prompt, images = prompt_of(row)
        completions = await sample(prompt, 1, images)
        return await scored(completions[0], row, images) if completions else None

    async def sample_group(row: dict, n: int) -> list[Optional[RolloutSample] | BaseException]:
        prompt, images = prompt_of(row)
        completions = await sample(prompt, n, images)
        if len(completions) != n:
            raise RuntimeError(f"the sampler returned {len(completions)} completions for a request of n={n}")
        # A reward that raises drops its own sample, not the group's others (a bug still stops the run).
        results = await asyncio.gather(*(scored(c, row, images) for c in completions), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # a cancellation or an interrupt
            if isinstance(result, Exception) and classify(result, retry_on) in ("bug", "fault"):
                raise result
        return list(results)  # a failed sample stays its exception: the group counts it

    # A sampler whose n completions may fail one by one is called per sample: a failure costs one
    # sample, not the group's.
    if sampler.group_requests:
        setattr(rollout_fn, GROUP_ATTRIBUTE, sample_group)
    return rollout_fn


class Trajectory:
    """Builds a multi-turn `RolloutSample`: environment turns (mask 0) and sampled turns (mask 1).

    Each sampled turn must continue the tokens so far exactly (the sampler saw them as its
    prompt), so the flattened lists stay parallel and the sampler logprobs line up token by token.
    Each sampled turn's span is recorded (`turn_spans`), for turn-level credit (`to_sample`).
    """

    def __init__(self, prompt_tokens: list[int], multi_modal: Optional[dict] = None) -> None:
        self.tokens = list(prompt_tokens)
        self.multi_modal = multi_modal
        """The prompt's images (`row_prompt`'s second value) for a vision-language policy: sample
        each turn with them (`sample_with_prompt_tokens(multi_modal=...)`); the sample keeps them
        (`RolloutSample.multi_modal`). None: text."""
        self.logprobs = [0.0] * len(self.tokens)
        self.loss_mask = [0] * len(self.tokens)
        self.turn_spans: list[tuple[int, int]] = []
        """The `[start, end)` range in `tokens` of each sampled turn's generated tokens, in order."""
        self.token_versions = [-1] * len(self.tokens)
        """Each token's weight version (-1: not generated, or not reported by the sampler)."""
        self._versioned = False

    def add_environment(self, tokens: list[int]) -> None:
        """Tokens the policy did not generate (user or tool turns): not trained on."""
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)
        self.token_versions += [-1] * len(tokens)

    def add_completion(self, c: Completion) -> None:
        """A sampled turn whose prompt was exactly this trajectory so far."""
        if list(c.full_tokens[: c.prompt_len]) != self.tokens:
            raise ValueError(
                "the completion's prompt is not this trajectory: sample with prompt_token_ids=trajectory.tokens"
            )
        generated = list(c.full_tokens[c.prompt_len :])
        self.turn_spans.append((len(self.tokens), len(self.tokens) + len(generated)))
        self.tokens += generated
        self.logprobs += list(c.sampling_logprobs)
        self.loss_mask += [1] * len(generated)
        self.token_versions += list(c.token_versions) if c.token_versions is not None else [-1] * len(generated)
        self._versioned = self._versioned or c.token_versions is not None

    def to_sample(
        self, reward: float, finish_reason: str = "stop", text: str = "", turn_rewards: Optional[list[float]] = None
    ) -> RolloutSample:
        """The flattened sample. With `turn_rewards` (one per sampled turn, e.g. each turn's
        information gain for `advantage=igpo`) it reports its turns: `turn_spans` and
        `turn_rewards`; without, neither (the checks drop a sample with spans but no rewards)."""
        spans = None
        if turn_rewards is not None:
            if len(turn_rewards) != len(self.turn_spans):
                raise ValueError(f"{len(turn_rewards)} turn_rewards for {len(self.turn_spans)} sampled turns")
            spans, turn_rewards = list(self.turn_spans), [float(r) for r in turn_rewards]
        return RolloutSample(
            list(self.tokens),
            list(self.logprobs),
            list(self.loss_mask),
            float(reward),
            finish_reason,
            text,
            turn_spans=spans,
            turn_rewards=turn_rewards,
            token_versions=list(self.token_versions) if self._versioned else None,
            multi_modal=self.multi_modal,
        )
