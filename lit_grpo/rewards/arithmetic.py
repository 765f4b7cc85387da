"""Exact-match reward for the arithmetic task."""

from __future__ import annotations

import re

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def score(completion: str, answer: str) -> float:
    """1.0 when the completion starts with the answer as a whole number, else 0.0.

    `"7"`, `" 7"` and `"7 is it"` score for answer 7; `"71"` and `"x7"` do not.
    """
    match = _LEADING_INT.match(completion)
    return 1.0 if match is not None and match.group(1) == str(answer).strip() else 0.0
