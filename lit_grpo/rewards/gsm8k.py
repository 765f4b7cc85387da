"""Correctness reward for GSM8K: 1.0 when the completion's final number equals the reference.

The model's final answer is found by the first rule that matches, in this order:

1. `#### N`: the GSM8K solution format; the first occurrence wins, since GSM8K solutions end
   at that line and whatever a model writes after it is run-on text.
2. `\\boxed{N}`: the last occurrence; the first number inside the braces.
3. An answer phrase, the last occurrence of any: "The answer is N", "answer: N" (also
   "Final answer = N"), or a line `A: N` (the format of OpenAI's labelled model solutions).
   Case-insensitive; N must follow the phrase directly (markdown `**` and `:` allowed between).
4. Otherwise the last number in the text.

GSM8K calculator annotations `<<16-3=13>>` are removed first, so their numbers never count.
A number may carry a sign, a currency sign ($, €, £), thousands commas ("1,000", but "1,2"
is two numbers) and decimals; a trailing period ("18."), units ("18 dollars", "20%") and
other text after it are ignored. A simple fraction "1/2" (integer over non-zero integer) is one
number. Numbers are compared as exact fractions (no float rounding) within a relative tolerance
of 1e-9, so "2.50" equals "2.5" and "3.0" equals "3" while "0.333" does not equal "1/3".

The reference is read the same way from the row as it was stored (registered reward `gsm8k`):
its `answer` (or `ground_truth`, `solution`) may be a bare number ("18", "1,000", 18), a whole
GSM8K solution ending `#### 18`, or a text with `\\boxed{18}`.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal
from fractions import Fraction
from typing import Optional

from lit_grpo.rewards.registry import RewardRowError, inline_reward, reference_field, register_reward

_ANNOTATION = re.compile(r"<<[^<>]*>>")
# Not preceded by a word character or '.', so the "3" of "x3" or of "1.3" is no number of its
# own; a minus sign counts only when attached ("-5", "-$5", "$-5"), so "16-3" and "5 - 3" read as
# two positive numbers.
_NUMBER = (
    r"(?<![\w.])(?P<sign>[-−](?=[$€£]?\d))?"
    r"[$€£]?(?P<sign2>(?<=[$€£])[-−](?=\d))?[ \t]?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
    r"(?:/(?P<den>\d+)(?!\d|/|\.\d))?"
)
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####[ \t]*" + _NUMBER)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_PHRASE_RE = re.compile(
    r"(?:\banswer\s*(?:is\b[ \t]*[:=]?|[:=])|^[ \t]*A[ \t]*:)[ \t*:=]*" + _NUMBER,
    re.IGNORECASE | re.MULTILINE,
)
_REL_TOL = Fraction(1, 10**9)


def _to_fraction(match: re.Match) -> Fraction:
    """The value of a `_NUMBER` match."""
    frac, den = match.group("frac"), match.group("den")
    value = Fraction(Decimal(match.group("int").replace(",", "") + (frac or "")))
    if den is not None and int(den) != 0:
        value /= int(den)
    return -value if match.group("sign") or match.group("sign2") else value


def _numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order."""
    return [_to_fraction(m) for m in _NUMBER_RE.finditer(text)]


def _format(value: Fraction) -> str:
    """Canonical string: "18", "-2.5", "0.125"; "1/3" when no finite decimal exists."""
    if value.denominator == 1:
        return str(value.numerator)
    # A finite decimal exists iff the denominator divides 10**k for some k <= denominator.
    for k in range(1, value.denominator.bit_length() + 1):
        if 10**k % value.denominator == 0:
            digits = Decimal(value.numerator * 10**k // value.denominator).scaleb(-k)
            return format(digits, "f").rstrip("0").rstrip(".")
    return f"{value.numerator}/{value.denominator}"


def _boxed_contents(text: str) -> list[str]:
    """The brace-balanced contents of every `\\boxed{...}`, in order."""
    contents = []
    for m in _BOXED_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        contents.append(text[m.end() : i - 1] if depth == 0 else text[m.end() :])
    return contents


def _final_value(text: str) -> Fraction | None:
    """The model's final answer as a number, by the rules of the module docstring."""
    text = _ANNOTATION.sub("", text)
    if hashes := _HASHES_RE.search(text):
        return _to_fraction(hashes)
    for content in reversed(_boxed_contents(text)):
        if values := _numbers(content):
            return values[0]
    if phrases := list(_PHRASE_RE.finditer(text)):
        return _to_fraction(phrases[-1])
    values = _numbers(text)
    return values[-1] if values else None


def extract_final_number(text: str) -> str | None:
    """The model's final answer in `text` as a canonical number string, or None if it has none."""
    value = _final_value(text)
    return None if value is None else _format(value)


def parse_reference_answer(answer: str) -> str:
    """The reference number of a bare answer ("18", "1,000", "$5") or of a solution (`#### 18`).

    Raises ValueError when `answer` holds no number.
    """
    number = extract_final_number(str(answer))
    if number is None:
        raise ValueError(f"reference answer {str(answer)[:80]!r} contains no number")
    return number


@functools.lru_cache(maxsize=1 << 16)
def _reference_value(answer: str) -> Optional[Fraction]:
    """The reference as a number (cached: every completion of a row is scored against it)."""
    return _final_value(parse_reference_answer(answer))


def score(completion: str, answer: str) -> float:
    """1.0 when the final number of `completion` equals the reference `answer` (a number or a
    solution, see `parse_reference_answer`), else 0.0; ValueError when `answer` holds no number."""
    reference = _reference_value(str(answer))
    value = _final_value(completion)
    if value is None or reference is None:
        return 0.0
    return 1.0 if abs(value - reference) <= _REL_TOL * max(Fraction(1), abs(reference)) else 0.0


ANSWER_FIELDS = ("answer", "ground_truth", "solution")
"""Where a row's reference is, the first one present."""


@register_reward("gsm8k")
@inline_reward
def gsm8k(completion_text: str, row: dict) -> float:
    """`score` of the completion against the row's reference, read as stored from the first of
    `answer`, `ground_truth`, `solution`: a number, a solution ending `#### N`, or `\\boxed{N}`."""
    field = reference_field(row, ANSWER_FIELDS, "gsm8k")
    value = row[field]
    # bool is an int subclass, but `true` as an answer is a data bug, not the number 1.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RewardRowError(f"reward 'gsm8k': the row's {field!r} must be a string or a number, got {value!r:.80}")
    try:
        return score(completion_text, str(value))
    except ValueError:
        raise RewardRowError(f"reward 'gsm8k': the row's {field!r} holds no number: {str(value)[:80]!r}") from None


# A line of its own `#### N` (N as `_NUMBER` reads it, a period after it allowed).
_ANSWER_LINE = re.compile(r"^[ \t]*####[ \t]*" + _NUMBER + r"[ \t]*\.?[ \t]*$", re.MULTILINE)


def format_score(completion: str) -> float:
    """1.0 when the completion puts an answer on a line of its own as `#### N`, else 0.0.

    `"3 + 4 = 7\n#### 7"`, `"#### 1,000."` and `"#### 7\nThe answer is 7."` score (the first
    `#### N` is the answer the `gsm8k` reward reads); `"The answer is 7"`, `"#### seven"`,
    `"#### 7 apples"` and `"so #### 7"` (not on a line of its own) do not. Whether N is right is the
    `gsm8k` reward's business."""
    return 1.0 if _ANSWER_LINE.search(_ANNOTATION.sub("", completion)) else 0.0


@register_reward("gsm8k_format")
@inline_reward
def gsm8k_format(completion_text: str, row: dict) -> float:
    """`format_score`: the GSM8K answer format, a shaping reward beside `gsm8k` for a model that
    rarely earns correctness (`reward.fn=[gsm8k,gsm8k_format] reward.weights=[1.0,0.5]`)."""
    return format_score(completion_text)
