"""The default rollout function: one completion per call, scored by the configured reward.

A user's own `make_rollout_fn(setup)` replaces this one (multi-turn, tools, retries); it only has
to return a `RolloutSample` (or None to drop the sample) per call. Each call is bounded by
`rollout_timeout_s`; a prompt (token ids or a templated chat) that leaves no room for a completion
within `data.max_seq_len` is refused by the sampler with `PromptTooLong` before it reaches the
engine, and the sample is counted as `rollout/dropped_prompt_too_long`.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Optional

from lit_grpo.samplers.base import chat_prompt_tokens
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
    )


def row_prompt_tokens(row: dict, tokenizer) -> list[int]:
    """A row's prompt: its `prompt_token_ids`, or its `messages` (minus any assistant answer) through the chat template."""
    if "prompt_token_ids" in row:
        return list(row["prompt_token_ids"])
    return chat_prompt_tokens(tokenizer, [m for m in row["messages"] if m.get("role") != "assistant"])


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    """Rows with `prompt_token_ids` are sampled token-in; rows with `messages` through the chat template."""
    sampler, sample_kwargs = setup.sampler, dict(setup.sample_kwargs)
    reward_fn = setup.extras["reward_fn"]

    async def rollout_fn(row: dict) -> Optional[RolloutSample]:
        completions = await sampler.sample_with_prompt_tokens(row_prompt_tokens(row, setup.tokenizer), n=1, **sample_kwargs)
        if not completions:
            return None
        c = completions[0]
        return sample_from_completion(c, reward_fn(c.text, row))

    return rollout_fn


class Trajectory:
    """Builds a multi-turn `RolloutSample`: environment turns (mask 0) and sampled turns (mask 1).

    Each sampled turn must continue the tokens so far exactly (the sampler saw them as its
    prompt), so the flattened lists stay parallel and the sampler logprobs line up token by token.
    """

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.tokens = list(prompt_tokens)
        self.logprobs = [0.0] * len(self.tokens)
        self.loss_mask = [0] * len(self.tokens)

    def add_environment(self, tokens: list[int]) -> None:
        """Tokens the policy did not generate (user or tool turns): not trained on."""
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)

    def add_completion(self, c: Completion) -> None:
        """A sampled turn whose prompt was exactly this trajectory so far."""
        if list(c.full_tokens[: c.prompt_len]) != self.tokens:
            raise ValueError("the completion's prompt is not this trajectory: sample with prompt_token_ids=trajectory.tokens")
        generated = list(c.full_tokens[c.prompt_len :])
        self.tokens += generated
        self.logprobs += list(c.sampling_logprobs)
        self.loss_mask += [1] * len(generated)

    def to_sample(self, reward: float, finish_reason: str = "stop", text: str = "") -> RolloutSample:
        return RolloutSample(list(self.tokens), list(self.logprobs), list(self.loss_mask), float(reward), finish_reason, text)
