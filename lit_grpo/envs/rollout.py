"""The generic environment rollout: any `lit_grpo.envs.api.Environment` played into a `RolloutSample`.

    rollout.factory=lit_grpo.envs.rollout:make_env_rollout_fn
    +rollout.extras.environment=my_env:MyEnv        # called with no argument for each episode
    +rollout.extras.max_turns=4                      # policy turns per episode (default 8)

`rollout.extras` (each checked when the run starts, named if wrong):

| key | default | |
|---|---|---|
| `environment` | (needed) | `module:callable` making each episode's environment (given `setup=` if it takes it) |
| `environment_kwargs` | `{}` | keyword arguments of that call |
| `max_turns` | 8 | policy turns; the episode ends after the last (`env/limit_turns`) |
| `max_tokens` | `max_turns` × `max_completion_tokens` | generated tokens in all (`env/limit_tokens`) |
| `max_seconds` | none | wall-clock seconds per episode, `step` calls included (`env/limit_seconds`) |
| `parse_error_penalty` | -1.0 | the reward part of a turn whose tool call cannot be parsed; the episode ends there |
| `stop` | none | stop strings of each turn (`</tool_call>`: a turn ends with its call, read with it) |
| `turn_tokens` | `sampler.max_completion_tokens` | the most tokens of one turn |
| `report_turns` | true | report `turn_spans` and `turn_rewards` (false: a plain sample, for GRPO) |

The episode's reward is the sum of its turns' parts (`StepResult.reward`); the sample reports
`turn_spans` and `turn_rewards` (the parts) so `advantage=igpo` credits turns. An episode that
outgrows `data.max_seq_len` ends where it is (`env/limit_length`), trained on what it has.
Metrics per sample: `env/turns`, `env/tool_calls`, `env/parse_error`, and the limit that ended it.

What the environment returns is checked (`lit_grpo.envs.checks`): a `reset`, `step` or `finish`
that is not `async def` or returns what the rollout cannot use drops the episode as one that raises
(`rollout/failures`), with a warning naming the method, where it is defined, and what it returned.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, Optional

from lit_grpo.envs.api import Environment, Episode, StepResult, Turn, parse_tool_calls
from lit_grpo.envs.checks import (
    EnvironmentReturnError,
    checked,
    credit_problem,
    described,
    method_name,
    prompt_problem,
    step_problem,
)
from lit_grpo.errors import UserError, import_user_object
from lit_grpo.rollouts.rollout import RolloutFn, Trajectory, text_prompt_tokens
from lit_grpo.samplers.arguments import PromptTooLong
from lit_grpo.types import RolloutSample, RolloutSetup

DEFAULT_MAX_TURNS = 8


def _extra(extras: dict, key: str, default: Any, check: Callable[[Any], bool], want: str) -> Any:
    value = extras.get(key, default)
    if not check(value):
        raise UserError(f"config field `rollout.extras.{key}`: must be {want}, got {value!r}")
    return value


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def environment_factory(extras: dict, setup: Optional[RolloutSetup] = None) -> Callable[[], Environment]:
    """`rollout.extras.environment` as a no-argument maker of episodes' environments (handing it
    `setup=` when it takes that keyword: the sampler, the tokenizer, the run's reward)."""
    spec = extras.get("environment")
    if spec is None:
        raise UserError(
            "config field `rollout.extras.environment`: needed by the environment rollout ('module:callable')"
        )
    maker = import_user_object(spec, "rollout.extras.environment") if isinstance(spec, str) else spec
    kwargs = _extra(extras, "environment_kwargs", {}, lambda v: isinstance(v, dict), "a mapping")
    if not callable(maker):
        raise UserError(f"config field `rollout.extras.environment`: {spec!r} is not callable")
    try:
        takes_setup = "setup" in inspect.signature(maker).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_setup = False
    if takes_setup:
        kwargs = {**kwargs, "setup": setup}

    def new_environment() -> Environment:
        env = maker(**kwargs)
        if not all(callable(getattr(env, name, None)) for name in ("reset", "step")):
            raise EnvironmentReturnError(
                f"config field `rollout.extras.environment`: {spec!r} returned {described(env)}; expected an "
                "environment, an object with `async def reset(row)` and `async def step(turn)`"
            )
        return env

    return new_environment


def make_env_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    """One episode of `rollout.extras.environment` per call (see the module docstring)."""
    extras, sampler, tokenizer = setup.extras, setup.sampler, setup.tokenizer
    vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    new_environment = environment_factory(extras, setup)
    turn_tokens = _extra(
        extras, "turn_tokens", int(setup.sample_kwargs.get("max_tokens", 64)), _is_positive_int, "an integer >= 1"
    )
    report_turns = _extra(extras, "report_turns", True, lambda v: isinstance(v, bool), "true or false")
    max_turns = _extra(extras, "max_turns", DEFAULT_MAX_TURNS, _is_positive_int, "an integer >= 1")
    max_tokens = _extra(extras, "max_tokens", max_turns * turn_tokens, _is_positive_int, "an integer >= 1")
    max_seconds = _extra(
        extras, "max_seconds", None, lambda v: v is None or (isinstance(v, (int, float)) and v > 0), "> 0 or null"
    )
    penalty = float(_extra(extras, "parse_error_penalty", -1.0, lambda v: isinstance(v, (int, float)), "a number"))
    stop = extras.get("stop")

    def encode(reply) -> list[int]:
        return list(reply) if isinstance(reply, (list, tuple)) else text_prompt_tokens(tokenizer, reply)

    async def rollout_fn(row: dict) -> Optional[RolloutSample]:
        env = new_environment()
        start = time.monotonic()

        def seconds_left() -> Optional[float]:
            return None if max_seconds is None else max_seconds - (time.monotonic() - start)

        async def within_time(awaitable):
            left = seconds_left()
            return await (awaitable if left is None else asyncio.wait_for(awaitable, max(left, 0.0)))

        async def call(obj, method: str, *args):
            """`obj.method(*args)` awaited within the episode's time; not a coroutine: named."""
            awaitable = getattr(obj, method)(*args)
            if not inspect.isawaitable(awaitable):
                raise EnvironmentReturnError(
                    f"{method_name(obj, method)} returned {described(awaitable)}, not an awaitable: "
                    f"it must be `async def {method}`"
                )
            return await within_time(awaitable)

        prompt = await call(env, "reset", row)
        checked(env, "reset", prompt_problem(prompt, vocab_size))
        traj = Trajectory(list(prompt) if isinstance(prompt, (list, tuple)) else text_prompt_tokens(tokenizer, prompt))
        parts: list[float] = []
        turns: list[Turn] = []
        metrics = {"env/tool_calls": 0.0, "env/parse_error": 0.0}
        generated, ended_by, finish_reason, texts = 0, None, "stop", []
        for index in range(max_turns):
            budget = min(turn_tokens, max_tokens - generated)
            kwargs = {**setup.sample_kwargs, "max_tokens": budget, **({"stop": stop} if stop else {})}
            try:
                (c,) = await within_time(sampler.sample_with_prompt_tokens(list(traj.tokens), n=1, **kwargs))
            except PromptTooLong:
                ended_by = "length"
                break
            except TimeoutError:
                ended_by = "seconds"
                break
            traj.add_completion(c)
            texts.append(c.text)
            generated += len(c.full_tokens) - c.prompt_len
            finish_reason = c.finish_reason
            # A stop string that ended the turn is cut from its text (the samplers' contract) but
            # read with it: `stop: ["</tool_call>"]` ends a turn with its call, closed.
            calls, error = parse_tool_calls(c.text + (c.stop_reason or ""))
            metrics["env/tool_calls"] += len(calls)
            if error is not None:
                metrics["env/parse_error"] = 1.0
                parts.append(penalty)
                ended_by = "parse_error"
                break
            turn = Turn(c.text, calls, None, index, c.finish_reason)
            turns.append(turn)
            try:
                result: StepResult = await call(env, "step", turn)
            except TimeoutError:
                parts.append(0.0)
                ended_by = "seconds"
                break
            checked(env, "step", step_problem(result, vocab_size))
            if result.reward is None:  # not applicable to this row: dropped, as a reward of None
                return None
            parts.append(float(result.reward))
            metrics.update(result.metrics)
            finish_reason = result.finish_reason or finish_reason
            if result.reply:
                traj.add_environment(encode(result.reply))
            if result.done:
                break
            if generated >= max_tokens:
                ended_by = "tokens"
                break
        else:
            ended_by = "turns"
        if not parts:  # not one turn was played (the prompt left no room)
            return None
        metrics["env/turns"] = float(len(parts))
        if ended_by is not None and ended_by != "parse_error":
            metrics[f"env/limit_{ended_by}"] = 1.0
        credit = None
        if report_turns:
            episode = Episode(row, list(traj.tokens), list(traj.turn_spans), turns)
            try:  # out of time: the parts stand as the turns' credit
                has_finish = getattr(env, "finish", None) is not None  # optional (lit_grpo.envs.api.finish_of)
                credit = None if ended_by == "seconds" or not has_finish else await call(env, "finish", episode)
            except TimeoutError:
                credit = None
            checked(env, "finish", credit_problem(credit, len(episode.turn_spans)))
            credit = parts if credit is None else credit
        sample = traj.to_sample(sum(parts), finish_reason, text="\n".join(texts), turn_rewards=credit)
        sample.metrics.update(metrics)
        return sample

    return rollout_fn
