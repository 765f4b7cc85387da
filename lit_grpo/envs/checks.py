"""What an environment returns, checked before the generic rollout uses it.

A wrong type or value (`step` returning a dict, a `reply` of 3.14, a NaN reward, `reset` returning
a dict) is the environment's mistake: `EnvironmentReturnError` names its class and method, where
the method is defined, what it returned and what was expected, in one line:

    MyEnv.step (my_env.py:12) returned a dict {'reward': 1.0}; expected a StepResult

Raised inside the rollout, it drops that episode as an environment that raises does (counted in
`rollout/failures`, through the circuit breaker of `lit_grpo.rollouts.checks`), rather than failing
later inside lit_grpo with a message about lit_grpo's own code or the tokenizer's.
"""

from __future__ import annotations

import inspect
import math
import numbers
import reprlib
from typing import Any, Optional

from lit_grpo.envs.api import StepResult
from lit_grpo.errors import UserError

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 40, 40, 6, 4


class EnvironmentReturnError(UserError):
    """An environment's method returned something the rollout cannot use; the message names it.

    Not a `TypeError` on purpose: those are the rollout's bugs and stop the run at once
    (`lit_grpo.rollouts.deadlines.BUG_ERRORS`), while this drops the episode and training goes on."""


def described(value: Any) -> str:
    """`a dict {'reward': 1.0}`: the type and a short repr of what the user returned."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} {_SHORT.repr(value)}"


def method_name(obj: Any, method: str) -> str:
    """`MyEnv.step (my_env.py:12)`: `obj`'s class, the method, and the file and line where it is defined."""
    name = f"{type(obj).__qualname__}.{method}"
    function = getattr(getattr(obj, method, None), "__func__", getattr(obj, method, None))
    if function is None:
        return name
    try:
        function = inspect.unwrap(function)
        return f"{name} ({inspect.getsourcefile(function)}:{function.__code__.co_firstlineno})"
    except (TypeError, ValueError, AttributeError):  # not a Python function (a builtin, a callable object)
        return name


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    """A Python bool, or a numpy one (`np.bool_`, what a gym-style `done` often is)."""
    dtype = getattr(value, "dtype", None)
    return isinstance(value, bool) or (dtype is not None and dtype.kind == "b" and getattr(value, "shape", None) == ())


def token_ids_problem(tokens: Any, vocab_size: Optional[int]) -> Optional[str]:
    """What is wrong with a list of token ids (ints in `[0, vocab_size)`), or None."""
    for i, token in enumerate(tokens):
        if not (isinstance(token, numbers.Integral) and not isinstance(token, bool)):
            return f"its item {i} is {described(token)}, not a token id (an int)"
        if int(token) < 0 or (vocab_size is not None and int(token) >= vocab_size):
            return f"its item {i} is token id {token}, outside the vocabulary [0, {vocab_size})"
    return None


def prompt_problem(prompt: Any, vocab_size: Optional[int]) -> Optional[str]:
    """`reset`'s return: `returned ...; expected ...` when it is not a prompt, else None."""
    expected = "expected the episode's prompt: a non-empty str, or a non-empty list of token ids"
    if isinstance(prompt, str) and prompt:
        return None
    if isinstance(prompt, (list, tuple)) and prompt:
        problem = token_ids_problem(prompt, vocab_size)
        return None if problem is None else f"returned {described(prompt)}: {problem}; {expected}"
    return f"returned {described(prompt)}; {expected}"


def step_problem(result: Any, vocab_size: Optional[int]) -> Optional[str]:
    """`step`'s return: `returned ...; expected ...` when it is not a usable `StepResult`, else None.
    Each field the rollout reads is checked: `reply`, `reward`, `done`, `metrics`, `finish_reason`."""
    if not isinstance(result, StepResult):
        return f"returned {described(result)}; expected a lit_grpo.envs.api.StepResult"

    def field(name: str, expected: str) -> str:
        value = getattr(result, name)
        return f"returned a StepResult with {name}={_SHORT.repr(value)} ({type(value).__name__}); expected {expected}"

    reply = result.reply
    if isinstance(reply, (list, tuple)):
        problem = token_ids_problem(reply, vocab_size)
        if problem is not None:
            return f"{field('reply', 'token ids')}: {problem}"
    elif reply is not None and not isinstance(reply, str):
        return field("reply", "a str, a list of token ids or None")
    reward = result.reward
    if reward is not None and not (_is_real(reward) and math.isfinite(reward)):
        return field("reward", "a finite number, or None to drop the episode")
    if not _is_bool(result.done):
        return field("done", "True or False")
    metrics = result.metrics
    if not isinstance(metrics, dict):
        return field("metrics", "a dict of metric name -> number")
    for key, value in metrics.items():
        if not isinstance(key, str) or not (value is None or _is_real(value)):
            return (
                f"returned a StepResult whose metrics hold {key!r}: {described(value)}; expected str keys and numbers"
            )
    if result.finish_reason is not None and not isinstance(result.finish_reason, str):
        return field("finish_reason", "a str or None")
    return None


def credit_problem(credit: Any, turns: int) -> Optional[str]:
    """`finish`'s return: `returned ...; expected ...` unless it is None or one finite number per turn."""
    expected = f"expected None or a list of {turns} finite numbers, one per policy turn"
    if credit is None:
        return None
    if not isinstance(credit, (list, tuple)) or len(credit) != turns:
        return f"returned {described(credit)}; {expected}"
    odd = [c for c in credit if not (_is_real(c) and math.isfinite(c))]
    return None if not odd else f"returned {described(credit)} (holding {described(odd[0])}); {expected}"


def checked(obj: Any, method: str, problem: Optional[str]) -> None:
    """Raise `EnvironmentReturnError` naming `obj.method` when `problem` is not None."""
    if problem is not None:
        raise EnvironmentReturnError(f"{method_name(obj, method)} {problem}")
