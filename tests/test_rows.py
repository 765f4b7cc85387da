"""Rows are the user's: loaded from JSONL, JSON, Parquet, CSV or a dataset folder and handed to the
rollout and the reward exactly as stored; the default rollout makes the prompt (text with the
tokenizer's special tokens, chat messages, token ids); a plain-prompt run needs no task module."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.config import ConfigError
from lit_grpo.errors import MissingExtraError
from lit_grpo.loop.evaluation import greedy_reward_sum
from lit_grpo.rollouts.rollout import make_rollout_fn, row_prompt_tokens
from lit_grpo.run.preflight import check_sources
from lit_grpo.run.validate import validate
from lit_grpo.tasks import evaluation_rows, training_rows
from lit_grpo.tasks.rows import MissingFileError, RowError, RowPromptError, load_rows
from lit_grpo.types import Completion, RolloutSetup

REPO = Path(__file__).resolve().parents[1]
DEEPMATH = {
    "question": "What is 100/3? — exactly",
    "answer": "\\dfrac{100}{3}",
    "id": "dm-7",
    "meta": {"source": "x", "level": 3},
}
# A rollout factory and a reward of a user's module: both record the rows they are handed.
RECORDER = """
from lit_grpo.rollouts.rollout import make_rollout_fn as default_factory

SEEN, SCORED = [], []


def make_rollout_fn(setup):
    rollout = default_factory(setup)

    async def record(row):
        SEEN.append(row)
        return await rollout(row)

    return record


def exact(completion_text, row):
    SCORED.append(row)
    return float(completion_text.strip() == str(row["answer"]))
"""
# Fast settings for one step of the tiny model; the reward filter is off (a random model's groups are uniform).
ONE_STEP = [
    "trainer.fast_dev_run=true",
    "trainer.enable_progress_bar=false",
    "data.prompt_groups_per_step=2",
    "data.completions_per_prompt=2",
    "~callbacks.reward_filter",
    "offpolicy.synchronous=true",
    "output_model_id=null",
]


def _jsonl(path: Path, rows: list[dict]) -> list[str]:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return lines


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """The module `rows_recorder` (RECORDER), importable from `tmp_path`."""
    (tmp_path / "rows_recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rows_recorder", raising=False)
    yield lambda: sys.modules["rows_recorder"]
    sys.modules.pop("rows_recorder", None)


# --------------------------------------------------------------------------- rows reach the rollout as stored


@pytest.mark.timeout(300)
def test_a_jsonl_row_reaches_the_rollout_and_the_reward_exactly_as_stored(tmp_path, recorder):
    from lit_grpo.train import train

    others = [
        {"question": "Und 2+2? ünïcode", "answer": 4, "id": "dm-8", "tags": ["a", None]},
        {"question": "1+1=", "answer": "2", "id": "dm-9"},
    ]
    lines = _jsonl(tmp_path / "deepmath.jsonl", [DEEPMATH, *others])
    train(
        compose_config(
            f"data.path={tmp_path / 'deepmath.jsonl'}",
            f"data.eval_path={tmp_path / 'deepmath.jsonl'}",
            "data.eval_rows=3",
            "data.prompt_field=question",
            "data.shuffle=false",
            "reward.fn=rows_recorder:exact",
            "rollout.factory=rows_recorder:make_rollout_fn",
            *ONE_STEP,
            output_dir=tmp_path / "run",
        )
    )
    seen, scored = recorder().SEEN, recorder().SCORED
    assert seen and scored and any(row["id"] == "dm-7" for row in seen)
    assert len(scored) > len(seen)  # the greedy evaluation scored the held-out rows too
    for row in seen + scored:
        line = lines[["dm-7", "dm-8", "dm-9"].index(row["id"])]
        assert row == json.loads(line)
        assert json.dumps(row, ensure_ascii=False) == line  # every field, in order, nothing added


@pytest.mark.timeout(300)
def test_rows_given_in_python_come_first_and_are_the_very_objects(tmp_path, recorder):
    from lit_grpo.build import build_run

    rows = [dict(DEEPMATH, id=f"py-{i}") for i in range(4)]
    snapshot = copy.deepcopy(rows)
    _jsonl(tmp_path / "other.jsonl", [{"prompt": "from the file", "answer": "1"}] * 4)
    c = validate(
        compose_config(
            f"data.path={tmp_path / 'other.jsonl'}",
            "data.prompt_field=question",
            "data.max_rows=3",
            "reward.fn=exact_match",
            "rollout.factory=rows_recorder:make_rollout_fn",
            *ONE_STEP,
            output_dir=tmp_path / "run",
        )
    )
    _, _, datamodule = build_run(c, rows=rows)
    try:
        next(iter(datamodule.train_dataloader()))
    finally:
        datamodule.close()
    seen = recorder().SEEN
    assert seen and all(any(row is r for r in rows[:3]) for row in seen)  # data.max_rows=3 applies to them too
    assert rows == snapshot


def test_precedence_and_max_rows(tmp_path):
    _jsonl(tmp_path / "rows.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(5)])
    c = validate(compose_config(f"data.path={tmp_path / 'rows.jsonl'}", "data.max_rows=4", output_dir=tmp_path))
    assert [r["answer"] for r in training_rows(c)] == ["0", "1", "2", "3"]
    assert training_rows(c, [{"prompt": "x"}] * 9) == [{"prompt": "x"}] * 4
    task_rows = training_rows(validate(compose_config("task.num_rows=6", output_dir=tmp_path)))
    assert len(task_rows) == 6 and set(task_rows[0]) == {"prompt", "answer"}  # the arithmetic task's, untouched
    c = validate(compose_config(f"data.eval_path={tmp_path / 'rows.jsonl'}", "data.eval_rows=2", output_dir=tmp_path))
    assert evaluation_rows(c) == [{"prompt": "0+0=", "answer": "0"}, {"prompt": "1+0=", "answer": "1"}]


def test_a_row_without_a_prompt_is_named_before_any_model_loads(tmp_path):
    _jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "answer": "2"}, DEEPMATH])
    c = validate(compose_config(f"data.path={tmp_path / 'rows.jsonl'}", output_dir=tmp_path))
    with pytest.raises(
        RowPromptError,
        match=r"rows\.jsonl, row 1: row id='dm-7' has none of the fields.*prompt_token_ids, "
        r"messages, prompt.*its fields: question, answer, id, meta.*data\.prompt_field=question",
    ):
        training_rows(c)
    c = validate(
        compose_config(f"data.path={tmp_path / 'rows.jsonl'}", "data.prompt_field=problem", output_dir=tmp_path)
    )
    with pytest.raises(RowPromptError, match=r"row 0: .*has no field 'problem' \(data\.prompt_field\)"):
        training_rows(c)
    # Another rollout reads the fields it likes: no check.
    c = validate(
        compose_config(
            f"data.path={tmp_path / 'rows.jsonl'}", "rollout.factory=my_rollouts:make_rollout_fn", output_dir=tmp_path
        )
    )
    assert training_rows(c)[1] == DEEPMATH


# --------------------------------------------------------------------------- the prompt


class _Recording:
    """A sampler that records each prompt and answers with a fixed text."""

    group_requests = False  # one request per sample, as a sampler that is not a BatchingSampler declares

    def __init__(self, text: str = "7") -> None:
        self.prompts: list[list[int]] = []
        self.text = text

    def _completion(self, prompt):
        return Completion(
            full_tokens=[*prompt, 20],
            prompt_len=len(prompt),
            sampling_logprobs=[-0.5],
            finish_reason="stop",
            text=self.text,
        )

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        self.prompts.append(list(prompt))
        return [self._completion(prompt)]

    def generate(self, prompts, temperature, max_tokens):
        self.prompts.extend(list(p) for p in prompts)
        return [self._completion(p) for p in prompts]


@pytest.fixture
def bos_tokenizer():
    """The tiny char tokenizer with a post-processor that puts a BOS first, as Llama's does."""
    from tokenizers.processors import TemplateProcessing

    from lit_grpo.models.load import build_char_tokenizer

    tokenizer = build_char_tokenizer("printable")
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    return tokenizer


def test_a_plain_prompt_gets_the_tokenizers_special_tokens_in_rollouts_and_evaluation(bos_tokenizer, tokenizer):

    bos = bos_tokenizer.bos_token_id
    chars = bos_tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    sampler = _Recording()
    rollout = make_rollout_fn(
        RolloutSetup(sampler, bos_tokenizer, {"max_tokens": 1}, {"reward_fn": lambda text, row: 1.0})
    )
    row = {"prompt": "3+4=", "answer": "7"}
    sample = asyncio.run(rollout(row))
    assert sampler.prompts == [[bos, *chars]] and sample.tokens[: len(chars) + 1] == [bos, *chars]
    assert asyncio.run(rollout(row)).tokens == sample.tokens  # the second call (cached tokens) is the same
    assert _greedy_accuracy(sampler, bos_tokenizer, [row], lambda text, r: 1.0, max_tokens=1, batch_size=4) == 1.0
    assert sampler.prompts[-1] == [bos, *chars]  # evaluation makes the prompt the same way
    # The demo's tokenizer has no post-processor: `tokenizer(text)` adds nothing, and that is what is used.
    assert (
        row_prompt_tokens(row, tokenizer)
        == tokenizer("3+4=")["input_ids"]
        == tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    )


def test_each_prompt_form(tokenizer):
    from lit_grpo.samplers.arguments import chat_prompt_tokens

    user = {"role": "user", "content": "2+3?"}
    shot = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert row_prompt_tokens({"prompt_token_ids": [5, 6], "prompt": "ignored"}, tokenizer) == [5, 6]
    # Assistant turns at the end are the answer, not the prompt; a few-shot turn in the middle stays.
    messages = [*shot, user, {"role": "assistant", "content": "5"}]
    assert row_prompt_tokens({"messages": messages}, tokenizer) == chat_prompt_tokens(tokenizer, [*shot, user])
    assert row_prompt_tokens({"question": "hi", "prompt": "no"}, tokenizer, "question") == tokenizer("hi")["input_ids"]
    assert row_prompt_tokens({"q": [user]}, tokenizer, "q") == chat_prompt_tokens(tokenizer, [user])
    with pytest.raises(
        RowPromptError,
        match=r"row \{'prompt': 3\}: its prompt field 'prompt' holds int 3; .*takes text, a non-empty list",
    ):
        row_prompt_tokens({"prompt": 3}, tokenizer)
    with pytest.raises(RowPromptError, match=r"row id='m-1': its prompt field 'messages' holds list \[\]"):
        row_prompt_tokens({"id": "m-1", "messages": []}, tokenizer)
    with pytest.raises(LookupError, match=r"has no field 'question'"):  # in a rollout: stops training at once
        row_prompt_tokens({"prompt": "x"}, tokenizer, "question")


# --------------------------------------------------------------------------- file formats


def test_jsonl_and_json_files(tmp_path):
    lines = _jsonl(tmp_path / "rows.jsonl", [DEEPMATH, {"prompt": "a"}])
    (tmp_path / "rows.jsonl").write_text(
        "\n" + lines[0] + "\n\n" + lines[1] + "\n", encoding="utf-8"
    )  # blank lines skipped
    assert load_rows(str(tmp_path / "rows.jsonl")) == [DEEPMATH, {"prompt": "a"}]
    (tmp_path / "rows.json").write_text(json.dumps([DEEPMATH, {"prompt": "a"}], indent=2))
    assert load_rows(str(tmp_path / "rows.json"), max_rows=1) == [DEEPMATH]
    (tmp_path / "lines.json").write_text("\n".join(lines))  # JSON lines under a .json name
    assert load_rows(str(tmp_path / "lines.json"))[1] == {"prompt": "a"}


@pytest.mark.parametrize(
    "content,message",
    [
        (b'{"prompt": "a"}\n{"prompt": \n', r"^rows\.jsonl line 2: invalid JSON"),
        (b'{"prompt": "a"}\n\n[1, 2]\n', r"^rows\.jsonl line 3: expected a JSON object"),
        (
            b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
            r"^rows\.jsonl line 2: not UTF-8 text \(byte 0xe9 at byte 16 of the line\)",
        ),
        (b"\n \n", r"data\.path=.*rows\.jsonl: no rows in it"),
    ],
)
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, content, message):
    (tmp_path / "rows.jsonl").write_bytes(content)
    with pytest.raises(RowError, match=message):
        load_rows(str(tmp_path / "rows.jsonl"))


@pytest.mark.timeout(120)
def test_parquet_and_csv_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    nested = [dict(DEEPMATH, id=f"dm-{i}") for i in range(3)]
    datasets.Dataset.from_list(nested).to_parquet(str(tmp_path / "rows.parquet"))
    assert load_rows(str(tmp_path / "rows.parquet")) == nested  # nested fields and all
    flat = [{"prompt": f"{i}+1=", "answer": i + 1, "id": f"r{i}", "note": "ü"} for i in range(3)]
    datasets.Dataset.from_list(flat).to_csv(str(tmp_path / "rows.csv"), index=False)
    rows = load_rows(str(tmp_path / "rows.csv"), max_rows=2)
    assert rows == flat[:2]  # CSV numbers come back as numbers, as the library reads them
    assert rows == datasets.load_dataset("csv", data_files=str(tmp_path / "rows.csv"), split="train").to_list()[:2]
    folder = tmp_path / "my_dataset"  # a local dataset folder, split by file name
    folder.mkdir()
    _jsonl(folder / "train.jsonl", nested)
    _jsonl(folder / "test.jsonl", nested[:1])
    assert load_rows(str(folder), split="test") == nested[:1]


def test_without_the_datasets_extra_the_error_names_it(tmp_path, monkeypatch):
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(
        MissingExtraError,
        match=r"parquet file .*rows\.parquet needs the `datasets` library: pip install 'lit_grpo\[datasets\]'",
    ):
        load_rows(str(tmp_path / "rows.parquet"))


# --------------------------------------------------------------------------- errors naming the field


def test_a_missing_file_is_named_by_its_field(tmp_path):
    c = validate(
        compose_config(
            "data.path=no_such_rows.jsonl", "data.eval_path=no_eval.parquet", "data.eval_rows=2", output_dir=tmp_path
        )
    )
    with pytest.raises(
        ConfigError, match=r"(?s)data\.path: no file no_such_rows\.jsonl.*data\.eval_path: no file no_eval\.parquet"
    ):
        check_sources(c)
    with pytest.raises(MissingFileError, match=r"^data\.path: no file no_such_rows\.jsonl"):
        training_rows(c)
    with pytest.raises(
        ConfigError, match=r"data\.eval_path.*is needed with data\.path=rows\.jsonl when data\.eval_rows > 0"
    ):
        validate(compose_config("data.path=rows.jsonl", "data.eval_rows=5", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"data\.prompt_field.*non-empty"):
        validate(compose_config("data.prompt_field=' '", output_dir=tmp_path))


def test_data_knobs_without_effect_are_named(tmp_path):
    from lit_grpo.config import ineffective_knobs

    knobs = ineffective_knobs(
        validate(
            compose_config("data.path=rows.jsonl", "data.split=validation", "data.eval_path=x.csv", output_dir=tmp_path)
        )
    )
    assert len(knobs) == 2 and "data.eval_path=x.csv" in knobs[0] and "data.eval_rows=0" in knobs[0]
    assert "data.split=validation has no effect: neither data.path nor data.eval_path is a dataset" in knobs[1]
    assert (
        ineffective_knobs(validate(compose_config("data.path=org/name", "data.split=validation", output_dir=tmp_path)))
        == []
    )


# --------------------------------------------------------------------------- the CLI, with no task module


def _cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.timeout(300)
def test_the_cli_trains_on_plain_prompts_with_a_reward_module_of_ones_own(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    _jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "my_reward.py").write_text(
        "def score(completion_text, row):\n    return 1.0 if completion_text.strip() == row['answer'] else 0.0\n"
    )
    proc = _cli(
        tmp_path,
        "data.path=rows.jsonl",
        "reward.fn=my_reward:score",
        "model=tiny",
        "max_steps=3",
        "offpolicy.synchronous=true",
        "data.prompt_groups_per_step=4",
        "data.completions_per_prompt=4",
        "sampler.max_completion_tokens=2",
        "~callbacks.reward_filter",
        "trainer.enable_progress_bar=false",
        "output_model_id=null",
        "hydra.run.dir=run",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["reward_curve"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "my_reward.py",
        "rows.jsonl",
        "run",
    ]  # no task module anywhere


@pytest.mark.timeout(300)
def test_the_cli_names_a_missing_data_file(tmp_path):
    proc = _cli(tmp_path, "data.path=rows.jsonl", "hydra.run.dir=run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "data.path: no file rows.jsonl" in proc.stderr[proc.stderr.rindex("error: ") :]


def _greedy_accuracy(*args, **kwargs) -> float:
    total, scored = greedy_reward_sum(*args, **kwargs)
    return total / scored


@pytest.mark.parametrize(
    "line,says",
    [
        (b"prompt,answer", "at column 1, at 'prompt,answer'; the line is not JSON"),
        (b"{'prompt': '3+4='}", "at column 2, at \"'prompt': '3+4='}\"; JSON strings take double quotes"),
        (b'{"prompt": "3+4=", "answer": ', "at column 30, at the end of the line; the row is cut short"),
        (b'{"prompt": "3+4="} 7', "Extra data at column 20, at '7'"),
    ],
)
def test_a_bad_json_row_shows_the_text_at_its_column_and_the_likely_cause(tmp_path, line, says):
    """`column 1` alone says little: the message shows what stands there, and the usual cause."""
    (tmp_path / "rows.jsonl").write_bytes(b'{"prompt": "a"}\n' + line + b"\n")
    with pytest.raises(RowError) as caught:
        load_rows(str(tmp_path / "rows.jsonl"))
    assert str(caught.value).startswith("rows.jsonl line 2: invalid JSON (") and says in str(caught.value)
    (tmp_path / "rows.json").write_text('[\n {"prompt": "a"},\n {"prompt": "b",}\n]')
    with pytest.raises(RowError, match=r"rows\.json: invalid JSON \(.* at line 3 column 17, at '}'"):
        load_rows(str(tmp_path / "rows.json"))
