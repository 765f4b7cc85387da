"""Message-in multi-turn rollouts with token-in/token-out stitching (the cookbook's
`MessageTrajectoryAssembler` and `TITOTokenizer`, written for lit_grpo).

A chat rollout thinks in messages, but training needs the exact tokens the sampler saw and
produced. Re-rendering the whole conversation through the chat template every turn would
re-tokenize the assistant's earlier answers, which need not give back the sampled tokens; so
the sampled tokens are kept as they are and only the messages appended after them (user, tool,
system) are tokenized, as the template would render them after an assistant turn.

    assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
    prompt = assembler.prepare_next_input(messages)
    c = (await sampler.sample_with_prompt_tokens(prompt, n=1, **kw))[0]
    assembler.add_assistant_response(request_messages=messages, assistant_message={...},
        prompt_token_ids=prompt, completion_token_ids=c.full_tokens[c.prompt_len:],
        completion_logprobs=c.sampling_logprobs)
    tokens, logprobs, loss_mask = assembler.trajectory.to_flat()
"""

from __future__ import annotations

from typing import Any, Optional

from lit_grpo.rollouts.rollout import Trajectory
from lit_grpo.samplers.arguments import chat_prompt_tokens, render_chat

DEFAULT_APPEND_ROLES = ("tool", "user", "system")
# A conversation that ends with an assistant turn: appended messages are rendered after it, so
# their tokens are what the template puts after any assistant turn.
_AFTER_ASSISTANT = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class MessageTrajectoryError(ValueError):
    """A conversation that cannot be stitched onto the tokens sampled so far."""


class PrefixMismatch(MessageTrajectoryError):
    """A sampler call whose prompt does not continue the trajectory's tokens."""


class TokenTrajectory(Trajectory):
    """A `Trajectory` built from sampler calls: each call's prompt must extend the tokens so far;
    the new prompt tokens are the environment's (mask 0), the output the policy's (mask 1)."""

    def __init__(self) -> None:
        super().__init__([])

    def add_call(self, input_tokens: list[int], output_tokens: list[int], output_logprobs: list[float]) -> None:
        """One sampler call: `input_tokens` it was prompted with, `output_tokens` and their logprobs."""
        if len(output_logprobs) != len(output_tokens):
            raise ValueError(f"{len(output_tokens)} output tokens but {len(output_logprobs)} logprobs")
        prior = self.tokens
        if list(input_tokens[: len(prior)]) != prior:
            at = next(
                (i for i, (a, b) in enumerate(zip(prior, input_tokens)) if a != b), min(len(prior), len(input_tokens))
            )
            raise PrefixMismatch(
                f"the call's prompt ({len(input_tokens)} tokens) leaves the trajectory ({len(prior)} tokens) "
                f"at token {at}: build the next prompt with prepare_next_input, not by re-rendering"
            )
        self.add_environment(list(input_tokens[len(prior) :]))
        self.tokens += list(output_tokens)
        self.logprobs += [float(lp) for lp in output_logprobs]
        self.loss_mask += [1] * len(output_tokens)

    def to_flat(self) -> tuple[list[int], list[float], list[int]]:
        """`(tokens, logprobs, loss_mask)`: the three parallel lists of a `RolloutSample`."""
        return list(self.tokens), list(self.logprobs), list(self.loss_mask)


class TITOTokenizer:
    """Renders a first prompt, and tokenizes the messages appended after an assistant turn."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template_kwargs: Optional[dict] = None,
        allowed_append_roles: Optional[list[str]] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.allowed_append_roles = list(allowed_append_roles or DEFAULT_APPEND_ROLES)

    def _template_kwargs(self, tools: Optional[list]) -> dict:
        return dict(self.chat_template_kwargs, **({"tools": tools} if tools else {}))

    def render(self, messages: list[dict], *, add_generation_prompt: bool, tools: Optional[list] = None) -> str:
        return render_chat(
            self.tokenizer, messages, add_generation_prompt=add_generation_prompt, **self._template_kwargs(tools)
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: the template already holds the special tokens it wants."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_initial_prompt(self, messages: list[dict], *, tools: Optional[list] = None) -> list[int]:
        """The first prompt: the whole conversation, ending with the assistant cue."""
        return chat_prompt_tokens(self.tokenizer, messages, **self._template_kwargs(tools))

    def tokenize_appended(
        self, old_messages: list[dict], new_messages: list[dict], *, tools: Optional[list] = None
    ) -> list[int]:
        """Tokens of `new_messages` beyond `old_messages` (which end with an assistant turn), then
        the assistant cue. `MessageTrajectoryError` unless the new list only appends allowed roles."""
        check_appended(old_messages, new_messages, self.allowed_append_roles)
        appended = new_messages[len(old_messages) :]
        base = self._base_for(appended)
        before = self.render(base, add_generation_prompt=False, tools=tools)
        after = self.render(base + appended, add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise MessageTrajectoryError(
                "the chat template renders earlier turns differently once messages are "
                "appended; these messages cannot be tokenized on their own"
            )
        return self.encode(after[len(before) :])

    def merge_tokens(
        self,
        *,
        old_messages: list[dict],
        new_messages: list[dict],
        pretokenized_token_ids: list[int],
        tools: Optional[list] = None,
    ) -> list[int]:
        """The next prompt: the tokens so far (sampled tokens kept as sampled) + the appended messages."""
        return list(pretokenized_token_ids) + self.tokenize_appended(old_messages, new_messages, tools=tools)

    @staticmethod
    def _base_for(appended: list[dict]) -> list[dict]:
        """An assistant turn for the appended messages to follow; tool results need its tool calls."""
        tools = [m for m in appended if m.get("role") == "tool"]
        if not tools:
            return list(_AFTER_ASSISTANT)
        calls = [
            {
                "id": m.get("tool_call_id") or f"call_{i}",
                "type": "function",
                "function": {"name": m.get("name") or "tool", "arguments": "{}"},
            }
            for i, m in enumerate(tools)
        ]
        return [_AFTER_ASSISTANT[0], {"role": "assistant", "content": "", "tool_calls": calls}]


def check_appended(old: list[dict], new: list[dict], allowed_roles: list[str]) -> None:
    """`MessageTrajectoryError` unless `new` is `old` plus messages of the allowed roles."""
    if list(new[: len(old)]) != list(old):
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), len(new))
        raise MessageTrajectoryError(
            f"message {at} differs from the conversation so far: a trajectory only grows at its end"
        )
    for i, message in enumerate(new[len(old) :], start=len(old)):
        if message.get("role") not in allowed_roles:
            raise MessageTrajectoryError(
                f"message {i} has role {message.get('role')!r}; only {allowed_roles} may be "
                "appended (assistant turns come from the sampler)"
            )


class MessageTrajectoryAssembler:
    """Keeps a chat rollout's messages and its token trajectory in step, turn after turn."""

    def __init__(self, tito_tokenizer: TITOTokenizer) -> None:
        self.tito_tokenizer = tito_tokenizer
        self.trajectory = TokenTrajectory()
        self.messages: list[dict] = []
        """The conversation up to and including the last assistant turn recorded."""

    @property
    def token_ids(self) -> list[int]:
        return list(self.trajectory.tokens)

    def prepare_next_input(self, request_messages: list[dict], *, tools: Optional[list] = None) -> list[int]:
        """The prompt tokens for the next sampler call on `request_messages`."""
        if not self.messages:
            return self.tito_tokenizer.render_initial_prompt(request_messages, tools=tools)
        return self.tito_tokenizer.merge_tokens(
            old_messages=self.messages,
            new_messages=request_messages,
            pretokenized_token_ids=self.trajectory.tokens,
            tools=tools,
        )

    def add_assistant_response(
        self,
        *,
        request_messages: list[dict],
        assistant_message: dict,
        prompt_token_ids: list[int],
        completion_token_ids: list[int],
        completion_logprobs: list[float],
        finish_reason: str = "stop",
    ) -> None:
        """Record one sampled turn: the prompt it was sampled from and the tokens it produced."""
        self.trajectory.add_call(prompt_token_ids, completion_token_ids, completion_logprobs)
        self.messages = list(request_messages) + [assistant_message]
        self.finish_reason = finish_reason
