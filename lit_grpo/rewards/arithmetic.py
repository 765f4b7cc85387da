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
