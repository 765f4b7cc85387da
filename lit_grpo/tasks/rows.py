"""The user's rows: loaded from a file or a dataset and handed to the rollout exactly as stored.

`data.path` names where the rows are:

- a JSONL file (`.jsonl`, `.ndjson`): one JSON object a line, read with the standard library;
  blank lines are skipped, a bad line is a `RowError` naming the file and the line;
- a JSON file (`.json`): a list of objects (a `.json` file that does not start with `[` is
  read as JSONL);
- a Parquet or CSV file (`.parquet`, `.csv`), read with the `datasets` library (the
  `lit_grpo[datasets]` extra): values come as that library reads them (CSV numbers as numbers);
- a Hugging Face dataset name or a local dataset folder: `datasets.load_dataset(path,
  data.dataset_config, split=data.split)`.

Nothing is renamed, parsed or added: every field of a row reaches the rollout function (and the
reward) as it was stored. Which field holds the prompt is the default rollout's business
(`prompt_field_of`, used by `lit_grpo.rollouts.rollout.row_prompt_tokens`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from lit_grpo.config.sources import hub_problem, source_kind
from lit_grpo.errors import MissingExtraError, UserError

DATASETS_HINT = "pip install 'lit_grpo[datasets]'"
PROMPT_FIELDS = ("prompt_token_ids", "messages", "prompt")
"""The fields the default rollout takes the prompt from, the first one a row has (`data.prompt_field=null`)."""
DEFAULT_ROLLOUT = "lit_grpo.rollouts.rollout:make_rollout_fn"


class RowError(UserError, ValueError):
    """A record that cannot become a row; the message names where it is and what is wrong."""


class MissingFileError(UserError, FileNotFoundError):
    """A data file that is not there; the message names it."""


class RowPromptError(UserError, LookupError):
    """A row without the prompt the default rollout needs. A LookupError, so that raised in a
    rollout it stops training at once (`rollouts.deadlines.BUG_ERRORS`); a UserError, so that the
    CLI prints its message alone."""


# --------------------------------------------------------------------------- JSONL and JSON


def json_line_reader(raw: bytes, where: str, *, first: bool, skip_hint: str = "") -> Callable[[], object]:
    """A function that decodes and parses one JSONL line; `RowError` naming `where` when the line
    is not UTF-8 text or not JSON. `skip_hint` is added to the fix (e.g. an option that skips lines)."""

    def read() -> object:
        try:  # a byte-order mark is allowed at the start of the file only
            line = raw.decode("utf-8-sig" if first else "utf-8")
        except UnicodeDecodeError as e:
            raise RowError(
                f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                f"re-save the file as UTF-8, or drop the line{skip_hint}"
            ) from None
        line = line.rstrip("\r\n")  # with its newline, a row cut short is reported at the next line's column 1
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: invalid JSON ({describe_json_error(line, e)})") from None

    return read


def describe_json_error(text: str, e: json.JSONDecodeError) -> str:
    """`json`'s message with the column and the text at it (a column alone, `column 1` most often,
    says little), and the usual cause where one is plain: a Python dict's single quotes, a line that
    is not JSON at all (a CSV row, a header), a row cut short."""
    lines = text.splitlines()
    line = lines[e.lineno - 1] if e.lineno <= len(lines) else ""
    at = line[max(e.colno - 1, 0) :].rstrip()
    shown = f"{at[:40]!r}" + ("..." if len(at) > 40 else "") if at else "the end of the line"
    where = f"line {e.lineno} column {e.colno}" if "\n" in text.strip() else f"column {e.colno}"
    cause = ""
    if at.startswith("'"):
        cause = "; JSON strings take double quotes (is it a Python dict's repr?)"
    elif e.colno == 1 and e.msg == "Expecting value":
        cause = '; the line is not JSON (a row is one object a line: {"prompt": ..., "answer": ...})'
    elif not at:
        cause = "; the row is cut short"
    return f"{e.msg} at {where}, at {shown}{cause}"


def jsonl_records(path: Path, *, skip_hint: str = "") -> Iterator[tuple[str, Callable[[], object]]]:
    """`(where, read_record)` per non-blank line of a JSONL file, lines numbered from 1; each line
    is decoded on its own, so a bad byte is named by its line. Lazy: reading stops when the caller does."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                where = f"{path.name} line {n}"
                yield where, json_line_reader(raw, where, first=n == 1, skip_hint=skip_hint)


def _require_object(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise RowError(f"{where}: expected a JSON object (a row is a dict of fields), got {type(record).__name__}")
    return record


def load_jsonl(path: str | os.PathLike, *, max_rows: int = 0) -> list[dict]:
    """The objects of a JSONL file, as `json.loads` returns them (at most `max_rows`; 0: all)."""
    rows = []
    for where, read in jsonl_records(Path(path)):
        rows.append(_require_object(read(), where))
        if max_rows and len(rows) >= max_rows:
            break
    return rows


def load_json(path: str | os.PathLike, *, max_rows: int = 0) -> list[dict]:
    """The objects of a JSON file holding a list of them; a file not starting with `[` is read as JSONL."""
    path = Path(path)
    raw = path.read_bytes()
    if not raw.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return load_jsonl(path, max_rows=max_rows)
    try:
        records = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise RowError(
            f"{path.name}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1}); re-save the file as UTF-8"
        ) from None
    except json.JSONDecodeError as e:
        raise RowError(f"{path.name}: invalid JSON ({describe_json_error(raw.decode('utf-8-sig'), e)})") from None
    records = records[:max_rows] if max_rows else records
    return [_require_object(r, f"{path.name} item {i}") for i, r in enumerate(records)]


# --------------------------------------------------------------------------- through `datasets`


def import_datasets(what: str):
    """The `datasets` module; `MissingExtraError` naming `what` needs it and the extra to install."""
    try:
        import datasets
    except ImportError:
        raise MissingExtraError(f"{what} needs the `datasets` library: {DATASETS_HINT}") from None
    return datasets


def _to_rows(dataset, max_rows: int) -> list[dict]:
    if max_rows and len(dataset) > max_rows:
        dataset = dataset.select(range(max_rows))  # convert only what is used
    return dataset.to_list()


def load_table(path: str | os.PathLike, kind: str, *, max_rows: int = 0) -> list[dict]:
    """The rows of a Parquet or CSV file (`kind`), as the `datasets` library reads them."""
    datasets = import_datasets(f"reading {kind} file {path}")
    return _to_rows(datasets.load_dataset(kind, data_files=str(path), split="train"), max_rows)


def load_dataset_rows(name: str, config: Optional[str], split: str, *, max_rows: int = 0) -> list[dict]:
    """The rows of split `split` of a Hugging Face dataset or a local dataset folder."""
    datasets = import_datasets(f"loading dataset {name!r}")
    return _to_rows(datasets.load_dataset(name, config, split=split), max_rows)


# --------------------------------------------------------------------------- any source


def load_rows(
    source: str,
    *,
    split: str = "train",
    dataset_config: Optional[str] = None,
    max_rows: int = 0,
    field: str = "data.path",
) -> list[dict]:
    """The rows of `source` (see the module docstring), at most `max_rows` (0: all), as stored.
    `MissingFileError` naming `field` when a file is not there; `RowError` when none is read."""
    kind = source_kind(source)
    path = Path(source).expanduser()
    if kind != "dataset" and not path.is_file():
        raise MissingFileError(f"{field}: {missing_file_message(source)}")
    if kind == "jsonl":
        rows = load_jsonl(path, max_rows=max_rows)
    elif kind == "json":
        rows = load_json(path, max_rows=max_rows)
    elif kind in ("parquet", "csv"):
        rows = load_table(path, kind, max_rows=max_rows)
    else:  # a folder here (`~` expanded), else a hub name
        rows = load_dataset_rows(str(path) if path.exists() else source, dataset_config, split, max_rows=max_rows)
    if not rows:
        raise RowError(f"{field}={source}: no rows in it")
    return rows


def missing_file_message(source: str) -> str:
    relative = (
        ""
        if Path(source).expanduser().is_absolute()
        else f" (a relative path is read from the working directory {os.getcwd()})"
    )
    return f"no file {source}{relative}"


def source_problem(source: str, field: str) -> Optional[str]:
    """Why `source` (config `field`) cannot be read from here, or None: a missing file, the
    `datasets` extra not installed, a dataset neither here nor reachable on the hub."""
    kind = source_kind(source)
    if kind != "dataset":
        if not Path(source).expanduser().is_file():
            return f"{field}: {missing_file_message(source)}"
        if kind in ("jsonl", "json"):
            return None
    if importlib.util.find_spec("datasets") is None:
        return f"{field}={source}: reading it needs the `datasets` library: {DATASETS_HINT}"
    if kind != "dataset":
        return None
    if why := hub_problem(source, "dataset"):
        return f"{field}={source}: {why}; give a local file (.jsonl, .json, .parquet, .csv) or dataset folder"
    return None


# --------------------------------------------------------------------------- prompts


def row_label(row: Any) -> str:
    """A short name of a row for messages and log lines: its `id`, else its prompt, else its repr."""
    if isinstance(row, dict):
        if "id" in row:
            return f"id={str(row['id'])[:60]!r}"
        for key in (*PROMPT_FIELDS, "question"):
            if isinstance(row.get(key), str):
                return f"{key}={row[key][:60]!r}"
    text = repr(row)
    return text if len(text) <= 100 else text[:97] + "..."


_PROMPT_FIX = (
    "Set data.prompt_field to the field that holds the prompt (text, chat messages or token ids), "
    "e.g. data.prompt_field=question, or give your own rollout (rollout.factory)"
)


def no_prompt_message(row: Any, prompt_field: Optional[str]) -> str:
    """What is wrong with a row the default rollout cannot take a prompt from, and the fix."""
    if not isinstance(row, dict):
        return f"a row must be a dict of fields, got {type(row).__name__}: {repr(row)[:80]}"
    fields = ", ".join(map(str, row)) or "none"
    wanted = (
        f"has no field {prompt_field!r} (data.prompt_field)" if prompt_field else
        f"has none of the fields the default rollout takes the prompt from ({', '.join(PROMPT_FIELDS)}; "
        "data.prompt_field=null)"
    )  # fmt: skip
    return f"row {row_label(row)} {wanted}; its fields: {fields}. {_PROMPT_FIX}"


def bad_prompt_message(row: dict, field: str) -> str:
    """A row whose prompt field holds a value the default rollout cannot sample from, and the fix."""
    value = row[field]
    return (
        f"row {row_label(row)}: its prompt field {field!r} holds {type(value).__name__} {repr(value)[:60]}; "
        "the default "
        f"rollout takes text, a non-empty list of chat messages or a list of token ids. {_PROMPT_FIX}"
    )


def prompt_field_of(row: dict, prompt_field: Optional[str] = None) -> str:
    """The field of `row` that holds its prompt: `prompt_field`, or the first of `PROMPT_FIELDS`
    the row has (not None); `RowPromptError` naming the row and its fields otherwise."""
    if isinstance(row, dict):
        for name in (prompt_field,) if prompt_field else PROMPT_FIELDS:
            if row.get(name) is not None:
                return name
    raise RowPromptError(no_prompt_message(row, prompt_field))


def check_prompts(rows: list[dict], prompt_field: Optional[str], source: str) -> None:
    """Every row has a prompt field (before any model loads); `RowPromptError` naming the first that has not."""
    for i, row in enumerate(rows):
        try:
            prompt_field_of(row, prompt_field)
        except RowPromptError as err:
            raise RowPromptError(f"{source}, row {i}: {err}") from None


def prompt_text(row: dict, tokenizer: Any = None, prompt_field: Optional[str] = None) -> str:
    """A row's prompt as text, from the field the default rollout reads (`prompt_field_of`): the
    text, the last user message of chat messages, or the token ids decoded; the row's label when
    it has no prompt field."""
    try:
        value = row[prompt_field_of(row, prompt_field)]
    except RowPromptError:
        return row_label(row)
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        return str(users[-1]) if users else str(value[-1].get("content"))
    if tokenizer is not None and isinstance(value, (list, tuple)):
        return tokenizer.decode(list(value))
    return str(value)
