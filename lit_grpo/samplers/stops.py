"""Stop strings: the `stop` sampling argument, and where a completion ends at one.

A completion ends at the first generated token whose decoding completes a stop string. That
token is kept (it was sampled: the trainer trains on it and needs its logprob); the text is cut
just before the stop string. When several stop strings are completed by the same token, the one
that ends earliest in the text wins, ties going to the first in the `stop` list. This is vLLM's
rule (`vllm.v1.engine.detokenizer.check_stop_strings`), so both samplers return the same
`Completion` for the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class StopMatch:
    """Where a completion ends at a stop string."""

    num_tokens: int
    """Generated tokens kept: up to and including the one whose decoding completed the stop string."""
    text: str
    """Those tokens decoded, cut just before the stop string."""
    stop: str
    """The stop string matched."""


def normalize_stop(stop: Any) -> tuple[str, ...]:
    """The `stop` sampling argument as a tuple of stop strings, in the caller's order (it breaks
    ties); None or an empty list: no stop strings. A ValueError for anything but str or a list of
    non-empty str (an empty stop string would end every completion before its first token)."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop must be a non-empty str or a list of non-empty str, got {stop!r}")
    return tuple(dict.fromkeys(strings))  # duplicates dropped, order kept


def first_stop(text: str, stops: Sequence[str]) -> Optional[tuple[str, int]]:
    """The stop string whose first occurrence in `text` ends earliest (ties: the first in `stops`)
    and the index where that occurrence starts; None when no stop string occurs in `text`."""
    best: Optional[tuple[str, int]] = None
    best_end = None
    for s in stops:
        start = text.find(s)
        if start != -1 and (best_end is None or start + len(s) < best_end):
            best, best_end = (s, start), start + len(s)
    return best


def find_stop(
    token_ids: Sequence[int], stops: Sequence[str], decode: Callable[[list[int]], str], text: Optional[str] = None
) -> Optional[StopMatch]:
    """Where the completion `token_ids` ends at a stop string, or None when its text holds none.

    `decode` turns token ids into text (special tokens skipped); `text`, when given, is
    `decode(token_ids)` already computed. Prefixes are always decoded from the first token, so a
    token that decodes to several characters (or to part of one) is handled: the completing token
    is the first k with a stop string in `decode(token_ids[:k])`. It is found by bisection, which
    takes about log2(len) prefix decodes, and one full decode only when no stop string occurs
    (decoded text only grows as tokens are added; were it to shrink, the bisection still ends at
    a token that completes a stop string).
    """
    if not stops:
        return None
    ids = list(token_ids)
    hi_text = decode(ids) if text is None else text
    if first_stop(hi_text, stops) is None:
        return None
    lo, hi = 0, len(ids)  # invariant: decode(ids[:lo]) holds no stop string, decode(ids[:hi]) = hi_text holds one
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_text = decode(ids[:mid])
        if first_stop(mid_text, stops) is None:
            lo = mid
        else:
            hi, hi_text = mid, mid_text
    stop, start = first_stop(hi_text, stops)  # type: ignore[misc]
    return StopMatch(num_tokens=hi, text=hi_text[:start], stop=stop)
