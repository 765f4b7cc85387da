"""The environment API: a game, a tool or a user the policy talks to, turn by turn.

An environment is an object with two coroutines (a `Protocol`, nothing to subclass), and an
optional third, `finish` (`finish_of`):

    class MyEnv:
        async def reset(self, row: dict) -> str | list[int]: ...        # the prompt: text, or token ids
        async def step(self, turn: Turn) -> StepResult: ...              # the policy's turn -> the reply

`lit_grpo.envs.rollout.make_env_rollout_fn` plays any such environment into a `RolloutSample`:
the policy's turns are trained on (mask 1), the prompt and the environment's replies are not
(mask 0), each turn's span and reward part are recorded (so `advantage=igpo` works on any
environment), and limits on turns, generated tokens and seconds end an episode that runs on.

A turn's tool calls are parsed from its text in the common JSON tool-call format (Hermes, Qwen,
and most chat templates): `<tool_call>{"name": "...", "arguments": {...}}</tool_call>`, one block
per call. A block that is not such an object is a parse error: the turn carries it (`parse_error`)
and the episode ends with `parse_error_penalty` as that turn's reward part, not a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, runtime_checkable

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""A tool-call block; its body is one JSON object `{"name": str, "arguments": object}`."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """The policy's turn as the environment sees it."""

    text: str
    """The generated text (special tokens skipped; cut before a stop string that ended it, which
    `tool_calls` were read with: `stop=["</tool_call>"]` closes the call)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The turn's tool calls, in order (empty: a plain answer)."""
    parse_error: Optional[str] = None
    """Why a `<tool_call>` block could not be read (then `tool_calls` holds the ones before it)."""
    index: int = 0
    """0 for the first turn of the episode."""
    finish_reason: str = "stop"
    """The sampler's: `length` when the turn hit its token limit."""


@dataclass
class StepResult:
    """What the environment answers a turn with."""

    reply: Union[str, list[int], None] = None
    """The environment's next message, as text (tokenized without special tokens) or token ids,
    appended after the turn and not trained on; None or empty: nothing to add."""
    reward: Optional[float] = 0.0
    """This turn's reward part. The episode's reward is the sum of its turns' parts; each part is
    also the turn's `turn_rewards` entry (for `advantage=igpo`) unless `finish` says otherwise.
    None: the episode's reward does not apply to its row (the sample is dropped, counted as
    `rollout/dropped_none`, as a reward of None is)."""
    done: bool = False
    """The episode ends after this turn (its reply, if any, is still appended)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Values to log (their mean over the step's samples); later turns overwrite earlier keys."""
    finish_reason: Optional[str] = None
    """The episode's finish reason when it ends here (None: the last turn's, as the sampler said)."""


@dataclass(frozen=True)
class Episode:
    """A finished episode, for an environment's optional `finish`."""

    row: dict
    tokens: list[int]
    """Every token: the prompt, the policy's turns, the environment's replies."""
    turn_spans: list[tuple[int, int]]
    """The `[start, end)` range in `tokens` of each policy turn."""
    turns: list[Turn]


@runtime_checkable
class Environment(Protocol):
    async def reset(self, row: dict) -> Union[str, list[int]]:
        """Start an episode for `row`: its prompt, as text or token ids."""

    async def step(self, turn: Turn) -> StepResult:
        """The environment's answer to the policy's turn."""


async def finish_of(env: Environment, episode: Episode) -> Optional[list[float]]:
    """An environment may also define `async def finish(self, episode) -> list[float] | None`: each
    policy turn's credit for `advantage=igpo` computed from the whole episode (the lookup game's
    information gains), in place of the turns' reward parts (None: the parts). The episode's
    reward stays the sum of the parts."""
    finish = getattr(env, "finish", None)
    return None if finish is None else await finish(episode)


def parse_tool_calls(text: str) -> tuple[tuple[ToolCall, ...], Optional[str]]:
    """The `<tool_call>` blocks of `text` as `ToolCall`s, and the first parse error (None: all
    read). A block must hold a JSON object with a string `name` and an object `arguments`
    (missing `arguments`: `{}`); an unclosed `<tool_call>` is an error too."""
    calls: list[ToolCall] = []
    for match in TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return tuple(calls), f"tool call {len(calls) + 1} is not JSON ({err.msg}): {body[:80]!r}"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return tuple(calls), f"tool call {len(calls) + 1} has no string 'name': {body[:80]!r}"
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some templates send the arguments JSON-encoded once more
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return tuple(calls), f"tool call {len(calls) + 1}'s arguments are not JSON: {arguments[:80]!r}"
        if not isinstance(arguments, dict):
            return tuple(calls), f"tool call {len(calls) + 1}'s arguments are not an object: {body[:80]!r}"
        calls.append(ToolCall(call["name"], arguments))
    if text.count("<tool_call>") > len(TOOL_CALL.findall(text)):
        return tuple(calls), "a <tool_call> block is not closed by </tool_call>"
    return tuple(calls), None
