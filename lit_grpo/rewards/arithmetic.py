"""Exact-match reward of the arithmetic task: the completion's leading whole number."""

from __future__ import annotations

import re

from lit_grpo.rewards.registry import inline_reward, reference_field, register_reward

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def score(completion: str, answer: str) -> float:
    """1.0 when the completion starts with the answer as a whole number, else 0.0.

    `"7"`, `" 7"` and `"7 is it"` score for answer 7; `"71"` and `"x7"` do not.
    """
    match = _LEADING_INT.match(completion)
    return 1.0 if match is not None and match.group(1) == str(answer).strip() else 0.0


@register_reward("arithmetic")
@inline_reward
def arithmetic(completion_text: str, row: dict) -> float:
    """`score` of the completion against the row's `answer`."""
    return score(completion_text, row[reference_field(row, ("answer",), "arithmetic")])


# A whole number: not part of a word or of a decimal ("x7", "1.5" hold none).
_LAST_INT = re.compile(r"(?<![\w.])-?\d+(?!\d)(?!\.\d)")


def last_integer_score(completion: str, answer: str) -> float:
    """1.0 when the last whole number in the completion is the answer, else 0.0.

    `"146"`, `"The sum is 146."` and `"39 + 107 = 146"` score for answer 146; `"146 or 147"`
    and `"146.5"` do not (the last number counts; a decimal is no whole number).
    """
    numbers = _LAST_INT.findall(completion)
    return 1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0


@register_reward("last_integer")
@inline_reward
def last_integer(completion_text: str, row: dict) -> float:
    """`last_integer_score` of the completion against the row's `answer`."""
    return last_integer_score(completion_text, row[reference_field(row, ("answer",), "last_integer")])
