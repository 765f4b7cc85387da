"""A sampler call's inputs and its errors: the sampling keywords a rollout may pass, the
(prompt, target) pairs to score, the chat prompt, and the two ways a request is refused or
abandoned (`PromptTooLong`, `SamplerTimeout`). Shared by every sampler, in-process or served."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from lit_grpo.samplers.stops import normalize_stop

SAMPLE_KWARGS = ("temperature", "max_tokens", "top_p", "top_k", "stop", "logprobs", "max_seq_len", "http_timeout")
"""The sampling keywords a rollout may pass (the hosted cookbook's sampler takes the same)."""


@dataclass(frozen=True)
class SampleArgs:
    """One request's sampling arguments, checked (see `check_sample_kwargs`)."""

    temperature: float
    max_tokens: int
    stop: tuple[str, ...] = ()
    max_seq_len: Optional[int] = None
    http_timeout: Optional[float] = None


def check_sample_kwargs(kwargs: dict[str, Any]) -> SampleArgs:
    """Validate a request's sampling kwargs; a ValueError names what is wrong (and, for an unknown
    keyword, the valid ones).

    - `temperature` (default 1.0; 0: greedy decoding), `max_tokens` (default 16).
    - `top_p` must be 1 and `top_k` 0 (or -1/None): truncated sampling would make the reported
      logprobs differ from the distribution the trainer's ratio assumes.
    - `stop`: a str or a list of str (None/empty: none). The completion ends at the first token
      whose decoding completes one: that token is kept, the text is cut before the string,
      `finish_reason` is "stop" and `stop_reason` the string (see `lit_grpo.samplers.stops`).
    - `logprobs`: True, 1 or None. The sampled tokens' logprobs are always returned (training
      needs them); False (none) and an int > 1 (top-k alternatives) cannot be honoured.
    - `max_seq_len`: a bound on prompt + completion for this request: max_tokens becomes
      min(max_tokens, max_seq_len - len(prompt)), and a prompt of max_seq_len tokens or more is
      refused with `PromptTooLong`.
    - `http_timeout`: seconds (> 0) this request may wait for its completion. These samplers run
      in-process, with no HTTP: it is the caller's deadline on the batched engine call the request
      joins (and on its wait in the queue); past it the call raises `SamplerTimeout`.
    """
    unknown = set(kwargs) - set(SAMPLE_KWARGS)
    if unknown:
        raise ValueError(f"unknown sampling arguments {sorted(unknown)}; valid: {', '.join(SAMPLE_KWARGS)}")
    if kwargs.get("top_p", 1.0) != 1.0 or kwargs.get("top_k", 0) not in (0, -1, None):
        raise ValueError("samplers only support top_p=1.0 and top_k=0: truncated sampling biases the logprobs")
    temperature = float(kwargs.get("temperature", 1.0))
    max_tokens = int(kwargs.get("max_tokens", 16))
    if temperature < 0 or max_tokens <= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy) and max_tokens > 0, got {temperature}, {max_tokens}")
    logprobs = kwargs.get("logprobs")
    if not (logprobs is None or logprobs is True or (type(logprobs) is int and logprobs == 1)):
        raise ValueError(
            f"logprobs={logprobs!r} cannot be honoured: samplers always return the logprob of each sampled "
            "token (training needs them) and never top-k alternatives; pass logprobs=True (or 1, or leave it out)"
        )
    max_seq_len = kwargs.get("max_seq_len")
    if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len <= 0):
        raise ValueError(
            f"max_seq_len must be a positive int (prompt + completion tokens) or None, got {max_seq_len!r}"
        )
    http_timeout = kwargs.get("http_timeout")
    if http_timeout is not None:
        if isinstance(http_timeout, bool) or not isinstance(http_timeout, (int, float)) or not http_timeout > 0:
            raise ValueError(f"http_timeout must be a number of seconds > 0 or None, got {http_timeout!r}")
        http_timeout = float(http_timeout)
    return SampleArgs(temperature, max_tokens, normalize_stop(kwargs.get("stop")), max_seq_len, http_timeout)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """`messages` as text through the policy's chat template (the one place lit_grpo renders one);
    `template_kwargs` reach the template (`tools`, `enable_thinking`, ...)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    assert isinstance(text, str)  # tokenize=False: one conversation's text
    return text


def chat_prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Token ids of `messages` through the policy's chat template, ending with the assistant cue
    (the rendered text holds the special tokens the template wants: none are added)."""
    return list(tokenizer(render_chat(tokenizer, messages, **template_kwargs), add_special_tokens=False)["input_ids"])


ScorePair = tuple[list[int], list[int]]
"""(prompt token ids, target token ids) to score: the target's logprobs given the prompt."""


def check_score_pairs(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], image_token_ids: Collection[int] = ()
) -> list[ScorePair]:
    """The pairs as lists of ints; a ValueError when a prompt or a target is empty (the first
    target token needs a token before it, and an empty target has no score), or holds one of
    `image_token_ids` (a vision-language policy's image placeholders: `score` takes no images, and
    would score the placeholders as plain tokens)."""
    checked = []
    for prompt, target in pairs:
        if len(prompt) == 0 or len(target) == 0:
            raise ValueError(f"score needs a non-empty prompt and target, got {len(prompt)} and {len(target)} tokens")
        pair = ([int(t) for t in prompt], [int(t) for t in target])
        if image_token_ids and not set(image_token_ids).isdisjoint(pair[0] + pair[1]):
            raise ValueError(
                "score takes text only: a prompt or target holds an image placeholder token, and its image "
                "would not be seen (score a vision-language policy's answers on text prompts)"
            )
        checked.append(pair)
    return checked


class PromptTooLong(ValueError):
    """A prompt leaves no room for a completion within `data.max_seq_len` (or the request's
    `max_seq_len`); it is never sent to the engine. A rollout that lets it propagate has the
    sample counted as `rollout/dropped_prompt_too_long` (not a failure)."""


class SamplerClosed(RuntimeError):
    """The sampler was cancelled (the run is ending): a call cut short, or made after, has no completions."""


class SamplerTimeout(TimeoutError):
    """A batched generate call did not return within the sampler's deadline (`call_timeout_s`),
    or a request's completion not within its `http_timeout`."""
