"""GSM8K rows from a local JSONL file: each record becomes `{"messages", "answer", "question"}`.

Two record formats are accepted, one JSON object a line:

- GSM8K (openai/grade-school-math): `question` plus `answer`, the solution ending `#### N`;
  the user message is `PROMPT_TEMPLATE` filled with the question.
- chat (tinker-cookbook style): `messages`, a list of `{role, content}` kept as given, plus an
  answer in `answer`, `ground_truth` or `solution` (a bare number or a text with `#### N`).

`answer` in a row is the reference as a canonical number string ("18", "2.5"), the form
`lit_grpo.rewards.gsm8k.score` compares against. A bad record raises `RowError` naming its
place (file and line) and the bad field, so a broken data file fails before any model loads;
a line that is not UTF-8 text is such a record too (each line is decoded on its own).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Iterable

from lit_grpo.errors import UserError
from lit_grpo.rewards.gsm8k import parse_reference_answer

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. "
    "Put the final answer on its own line as '#### <number>'.\n\n{question}"
)
ANSWER_FIELDS = ("answer", "ground_truth", "solution")
ON_ERROR_MODES = ("raise", "skip")


class RowError(UserError, ValueError):
    """A record that cannot become a row; the message names where it is and what is wrong."""


class MissingFileError(UserError, FileNotFoundError):
    """A data file that is not there; the message names it."""


def _answer(record: dict, where: str) -> str:
    """The reference number of the first answer field present, canonicalised."""
    field = next((f for f in ANSWER_FIELDS if record.get(f) is not None), None)
    if field is None:
        raise RowError(f"{where}: missing answer field (one of {', '.join(ANSWER_FIELDS)})")
    value = record[field]
    # bool is an int subclass, but `true` as an answer is a data bug, not the number 1.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"{where}: field '{field}' must be a string or a number, got {value!r}")
    try:
        return parse_reference_answer(str(value))
    except ValueError:
        raise RowError(f"{where}: field '{field}' holds no number: {str(value)[:80]!r}") from None


def _check_messages(messages: object, where: str) -> list[dict]:
    """`messages` itself when it is a non-empty list of string role/content dicts with a user turn."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: field 'messages' must be a non-empty list, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
            raise RowError(
                f"{where}: messages[{i}] must be a dict with string 'role' and 'content', got {m!r:.80}"
            )
    if not any(m["role"] == "user" for m in messages):
        raise RowError(f"{where}: field 'messages' has no 'user' message")
    return messages


def normalize_record(record: dict, where: str) -> dict:
    """The row of a GSM8K-format or chat-format record; RowError (naming `where`) if malformed."""
    if not isinstance(record, dict):
        raise RowError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = _check_messages(record["messages"], where)
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    elif "question" in record:
        question = record["question"]
        if not isinstance(question, str) or not question.strip():
            raise RowError(f"{where}: field 'question' must be a non-empty string, got {question!r:.80}")
        messages = [{"role": "user", "content": PROMPT_TEMPLATE.format(question=question)}]
    else:
        raise RowError(f"{where}: missing field 'question' (or 'messages' for a chat record)")
    return {"messages": messages, "answer": _answer(record, where), "question": question}


def collect_rows(records: Iterable[tuple[str, Callable[[], object]]], *, source: str, on_error: str = "raise", max_rows: int = 0) -> tuple[list[dict], list[str]]:
    """Rows of `(where, read_record)` pairs and the problems of those skipped.

    `on_error="raise"` raises RowError at the first bad record; `"skip"` logs a warning per bad
    record and lists it in the problems. `max_rows` > 0 stops after that many rows. RowError
    (naming `source`) if no record yields a row.
    """
    if on_error not in ON_ERROR_MODES:
        raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0 (0 means all rows), got {max_rows}")
    rows: list[dict] = []
    problems: list[str] = []
    for where, read_record in records:
        try:
            rows.append(normalize_record(read_record(), where))
        except RowError as e:
            if on_error == "raise":
                raise
            log.warning("skipping %s", e)
            problems.append(str(e))
            continue
        if max_rows and len(rows) >= max_rows:
            break
    if not rows:
        detail = f"{len(problems)} bad records, first: {problems[0]}" if problems else "it is empty"
        raise RowError(f"{source}: no usable rows ({detail})")
    return rows, problems


def _json_line(raw: bytes, where: str, *, first: bool) -> Callable[[], object]:
    def read() -> object:
        try:  # a byte-order mark is allowed at the start of the file only
            line = raw.decode("utf-8-sig" if first else "utf-8")
        except UnicodeDecodeError as e:
            raise RowError(
                f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                "re-save the file as UTF-8, or drop the line (task.on_error=skip skips it)"
            ) from None
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None

    return read


def load_jsonl_rows(path: str | Path, *, on_error: str = "raise", max_rows: int = 0) -> tuple[list[dict], list[str]]:
    """Rows of a JSONL file (blank lines ignored, lines numbered from 1) and the problems of the lines skipped."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"GSM8K JSONL file not found: {path}")
    with path.open("rb") as f:
        lines = [
            (f"{path.name} line {n}", _json_line(raw, f"{path.name} line {n}", first=n == 1))
            for n, raw in enumerate(f, start=1) if raw.strip()
        ]  # fmt: skip
    return collect_rows(lines, source=path.name, on_error=on_error, max_rows=max_rows)
