"""GSM8K rows from a local JSONL file or a dataset's records: checked, and kept as stored.

Two record formats are accepted, one JSON object a line:

- GSM8K (openai/grade-school-math): `question` plus `answer`, the solution ending `#### N`;
- chat (tinker-cookbook style): `messages`, a list of `{role, content}`, plus an answer in
  `answer`, `ground_truth` or `solution` (a bare number, a text with `#### N` or `\\boxed{N}`).

A record keeps every field exactly as stored (the answer is not rewritten: the `gsm8k` reward
reads it as it is). The one addition: a record with no prompt field at all (none of
`prompt_token_ids`, `messages`, `prompt`; a raw GSM8K record) gets a `messages` field, one user
message, `PROMPT_TEMPLATE` filled with its `question`. A bad record raises `RowError` naming its
place (file and line) and the bad field, so a broken data file fails before any model loads; a
line that is not UTF-8 text is such a record too (each line is decoded on its own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from lit_grpo.rewards.gsm8k import ANSWER_FIELDS, parse_reference_answer
from lit_grpo.tasks.rows import PROMPT_FIELDS, MissingFileError, RowError, jsonl_records

__all__ = ["ANSWER_FIELDS", "ON_ERROR_MODES", "PROMPT_TEMPLATE", "MissingFileError", "RowError", "check_record",
           "collect_rows", "load_jsonl_rows"]  # fmt: skip

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. "
    "Put the final answer on its own line as '#### <number>'.\n\n{question}"
)
ON_ERROR_MODES = ("raise", "skip")


def _check_answer(record: dict, where: str) -> None:
    """The first answer field present holds a number (it is not rewritten)."""
    field = next((f for f in ANSWER_FIELDS if record.get(f) is not None), None)
    if field is None:
        raise RowError(f"{where}: missing answer field (one of {', '.join(ANSWER_FIELDS)})")
    value = record[field]
    # bool is an int subclass, but `true` as an answer is a data bug, not the number 1.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"{where}: field '{field}' must be a string or a number, got {value!r}")
    try:
        parse_reference_answer(str(value))
    except ValueError:
        raise RowError(f"{where}: field '{field}' holds no number: {str(value)[:80]!r}") from None


def _check_messages(messages: object, where: str) -> None:
    """`messages` is a non-empty list of string role/content dicts with a user turn."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: field 'messages' must be a non-empty list, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
            raise RowError(f"{where}: messages[{i}] must be a dict with string 'role' and 'content', got {m!r:.80}")
    if not any(m["role"] == "user" for m in messages):
        raise RowError(f"{where}: field 'messages' has no 'user' message")


def check_record(record: object, where: str, *, template: str = PROMPT_TEMPLATE) -> dict:
    """The row of a GSM8K-format or chat-format record: the record itself, with a `messages`
    field (`template` filled with its `question`) added only when it has no prompt field (see the
    module docstring); RowError naming `where` if malformed."""
    if not isinstance(record, dict):
        raise RowError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        _check_messages(record["messages"], where)
    elif any(record.get(f) is not None for f in PROMPT_FIELDS):
        pass  # a prompt of another form: the rollout reads it as it is
    elif "question" in record:
        question = record["question"]
        if not isinstance(question, str) or not question.strip():
            raise RowError(f"{where}: field 'question' must be a non-empty string, got {question!r:.80}")
    else:
        raise RowError(f"{where}: missing field 'question' (or 'messages' for a chat record)")
    _check_answer(record, where)
    if not any(record.get(f) is not None for f in PROMPT_FIELDS):
        record["messages"] = [{"role": "user", "content": template.format(question=record["question"])}]
    return record


def collect_rows(
    records: Iterable[tuple[str, Callable[[], object]]],
    *,
    source: str,
    on_error: str = "raise",
    max_rows: int = 0,
    template: str = PROMPT_TEMPLATE,
) -> tuple[list[dict], list[str]]:
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
            rows.append(check_record(read_record(), where, template=template))
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


def load_jsonl_rows(
    path: str | Path, *, on_error: str = "raise", max_rows: int = 0, template: str = PROMPT_TEMPLATE
) -> tuple[list[dict], list[str]]:
    """Rows of a JSONL file (blank lines ignored, lines numbered from 1) and the problems of the lines skipped."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"GSM8K JSONL file not found: {path}")
    if on_error not in ON_ERROR_MODES:  # before the file is opened
        raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
    records = jsonl_records(path, skip_hint=" (task.on_error=skip skips it)")
    return collect_rows(records, source=path.name, on_error=on_error, max_rows=max_rows, template=template)
