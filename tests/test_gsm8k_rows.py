"""GSM8K rows from JSONL: both record formats kept as stored (a raw record only gains `messages`),
and bad lines reported by file, line and field."""

import json
import logging
import re
from pathlib import Path

import pytest

from lit_grpo.tasks.gsm8k_rows import PROMPT_TEMPLATE, RowError, check_record, load_jsonl_rows

SAMPLE = Path(__file__).resolve().parent / "data" / "gsm8k_test_sample.jsonl"
GOOD = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}


def _write(tmp_path: Path, lines: list, name: str = "gsm8k.jsonl") -> Path:
    """A JSONL file of `lines`: dicts are dumped, strings written as they are."""
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines), encoding="utf-8")
    return path


def test_vendored_sample_keeps_every_field_and_gains_only_messages():
    rows, problems = load_jsonl_rows(SAMPLE)
    raw = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 40 and problems == []
    assert rows[0]["answer"].endswith("#### 18")  # the whole solution, as stored: the reward parses it
    for row, x in zip(rows, raw):
        prompt = [{"role": "user", "content": PROMPT_TEMPLATE.format(question=x["question"])}]
        assert row == {**x, "messages": prompt}  # every stored field, unchanged, plus the prompt


def test_chat_records_are_kept_exactly_as_stored():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    for field, value in [
        ("answer", "5"),
        ("ground_truth", "so #### 1,000"),
        ("solution", 2.50),
        ("answer", "\\boxed{5}"),
    ]:
        record = {"id": "c-1", "messages": messages, field: value, "meta": {"level": 2}}
        stored = json.loads(json.dumps(record))
        assert check_record(record, "x line 1") == stored  # nothing renamed, parsed, added or dropped
    cookbook = {
        "id": "gsm-3",
        "messages": messages + [{"role": "assistant", "content": "5"}],
        "answer": "2+3=5\n#### 5",
    }
    assert check_record(json.loads(json.dumps(cookbook)), "x line 2") == cookbook
    prompt_row = {"prompt": "2+3=", "answer": "5"}  # another prompt field: no messages added
    assert check_record(dict(prompt_row), "x line 3") == prompt_row


@pytest.mark.parametrize(
    "record,field",
    [
        ({"answer": "#### 5"}, "'question'"),
        ({"question": "How many?"}, "missing answer field"),
        ({"question": "How many?", "answer": "five, I think"}, "'answer' holds no number"),
        ({"question": "", "answer": "5"}, "'question' must be a non-empty string"),
        ({"question": "How many?", "answer": True}, "'answer' must be a string or a number"),
        ({"messages": "What is 2+3?", "answer": "5"}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}], "answer": "5"}, "messages[0] must be a dict"),
        ({"messages": [{"role": "system", "content": "Hi"}], "answer": "5"}, "no 'user' message"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_records_name_place_and_field(record, field):
    with pytest.raises(RowError) as err:
        check_record(record, "gsm8k.jsonl line 17")
    assert str(err.value).startswith("gsm8k.jsonl line 17: ") and field in str(err.value)


def _bad_file(tmp_path: Path) -> Path:
    # line 2: no answer; line 3: broken JSON; line 4 blank; line 6: answer without a number
    return _write(tmp_path, [GOOD, {"question": "q"}, '{"question": "q", ', "", GOOD, {**GOOD, "answer": "none"}, GOOD])


def test_raise_mode_stops_at_the_first_bad_line(tmp_path):
    with pytest.raises(RowError, match=r"^gsm8k\.jsonl line 2: missing answer field"):
        load_jsonl_rows(_bad_file(tmp_path))
    with pytest.raises(RowError, match=r"^gsm8k\.jsonl line 3: invalid JSON"):
        load_jsonl_rows(_write(tmp_path, [GOOD, GOOD, "{not json", GOOD]))


def test_skip_mode_skips_bad_lines_and_lists_them(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        rows, problems = load_jsonl_rows(_bad_file(tmp_path), on_error="skip")
    assert [r["answer"] for r in rows] == [GOOD["answer"]] * 3
    assert [p.split(":")[0] for p in problems] == ["gsm8k.jsonl line 2", "gsm8k.jsonl line 3", "gsm8k.jsonl line 6"]
    assert "missing answer field" in problems[0] and "invalid JSON" in problems[1]
    assert "'answer' holds no number" in problems[2]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3


def test_max_rows_stops_after_that_many_valid_rows(tmp_path):
    rows, problems = load_jsonl_rows(_bad_file(tmp_path), on_error="skip", max_rows=2)
    assert len(rows) == 2 and len(problems) == 2  # line 6 is never read
    assert len(load_jsonl_rows(SAMPLE, max_rows=5)[0]) == 5


def test_files_with_no_usable_rows_are_errors(tmp_path):
    with pytest.raises(RowError, match="no usable rows.*empty"):
        load_jsonl_rows(_write(tmp_path, ["", "  "], name="empty.jsonl"))
    with pytest.raises(RowError, match=r"bad\.jsonl: no usable rows \(2 bad records"):
        load_jsonl_rows(_write(tmp_path, ["[", {"question": "q"}], name="bad.jsonl"), on_error="skip")


def test_missing_file_and_bad_arguments(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_jsonl_rows(missing)
    with pytest.raises(ValueError, match="on_error"):
        load_jsonl_rows(SAMPLE, on_error="ignore")
    with pytest.raises(ValueError, match="max_rows"):
        load_jsonl_rows(SAMPLE, max_rows=-1)


def _with_bad_bytes(tmp_path: Path) -> Path:
    """Lines 1 and 4 are good; line 2 holds a Latin-1 byte (0xe9, "é"); line 3 a cut UTF-8 sequence."""
    good = json.dumps(GOOD).encode()
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b"\n".join(
            [good, b'{"question": "Caf\xe9?", "answer": "#### 1"}', b'{"question": "\xe2\x82", "answer": "1"}', good]
        )
        + b"\n"
    )
    return path


def test_a_non_utf8_line_is_a_row_error_naming_file_line_and_byte(tmp_path):
    from lit_grpo.errors import UserError

    with pytest.raises(
        RowError, match=r"^latin1\.jsonl line 2: not UTF-8 text \(byte 0xe9 at byte 18 of the line\); re-save"
    ) as err:
        load_jsonl_rows(_with_bad_bytes(tmp_path))
    assert isinstance(err.value, UserError)  # the CLI prints it and exits 2
    rows, problems = load_jsonl_rows(_with_bad_bytes(tmp_path), on_error="skip")
    assert len(rows) == 2 and [p.split(":")[0] for p in problems] == ["latin1.jsonl line 2", "latin1.jsonl line 3"]
    assert "byte 0xe2" in problems[1]


def test_a_byte_order_mark_starts_the_file_only(tmp_path):
    good = json.dumps(GOOD).encode()
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\r\n" + good + b"\r\n")  # Windows Notepad's UTF-8
    assert [r["answer"] for r in load_jsonl_rows(path)[0]] == [GOOD["answer"]] * 2
    path.write_bytes(good + b"\n\xef\xbb\xbf" + good + b"\n")
    with pytest.raises(RowError, match=r"bom\.jsonl line 2: invalid JSON"):
        load_jsonl_rows(path)


def test_task_prompt_template_writes_the_user_message_of_question_records_only(tmp_path):
    from lit_grpo.tasks.gsm8k import GSM8KOptions, load_split

    template = "{question}\n\nBe brief; end with '#### <number>'."
    chat = {"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}
    path = _write(tmp_path, [GOOD, chat])
    rows = load_split(GSM8KOptions(path=str(path), prompt_template=template), held_out=False, limit=0)
    assert rows[0]["messages"] == [
        {"role": "user", "content": GOOD["question"] + "\n\nBe brief; end with '#### <number>'."}
    ]
    assert rows[1] == chat  # a chat record keeps its own messages


@pytest.mark.parametrize(
    "template,words",
    [
        ("Answer briefly.", "must contain `{question}`"),
        ("{question} in {units}", "braces other than"),
        ("{question} {", "braces other than"),
    ],
)
def test_a_prompt_template_without_its_question_or_with_other_braces_is_refused(template, words):
    from lit_grpo.config import ConfigError
    from lit_grpo.tasks.gsm8k import GSM8KOptions

    with pytest.raises(ConfigError, match=re.escape("task.prompt_template") + ".*" + re.escape(words)):
        GSM8KOptions(prompt_template=template)
