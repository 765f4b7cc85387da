"""Faults of a vision-language run, through the real CLI as for text (`test_faults_cli.py`): a row
whose image cannot be used drops that row's samples with one warning naming the row and the run
goes on; a run whose every row is bad stops with one `error:` message; a config that cannot take
images is refused at the start, naming the field, before a model loads.

Each run is the tiny VLM's demo (`+experiment=vlm_shapes`) on a JSONL file of our own, two steps.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from test_faults_cli import _assert_user_error, _cli

pytestmark = pytest.mark.timeout(120)

QUESTION = {"type": "text", "text": "colour of the square? r g b y"}
BAD = "bad"
"""The id of the one bad row, first in the file (rows unshuffled: it is sampled at step 0)."""


def _row(row_id: str, content: list[dict], **fields) -> dict:
    return {"id": row_id, "messages": [{"role": "user", "content": content}], "answer": "r", **fields}


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def red(tmp_path) -> str:
    path = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (220, 30, 30)).save(path)
    return str(path)


def _vlm_run(tmp_path: Path, data: Path, *more: str) -> tuple[subprocess.CompletedProcess, float]:
    return _cli(
        tmp_path,
        "+experiment=vlm_shapes",
        f"data.path={data}",
        "data.shuffle=false",
        "max_steps=2",
        "data.completions_per_prompt=2",
        "data.prompt_groups_per_step=2",
        f"hydra.run.dir={tmp_path / 'run'}",
        *more,
    )


def _warnings(proc: subprocess.CompletedProcess) -> list[str]:
    """The run's warning lines (the log goes to stdout; the progress bar's `\\r` splits lines too)."""
    lines = (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
    return [line[line.index("WARNING") :] for line in lines if "[WARNING]" in line]


def _metric_total(run_dir: Path, key: str) -> float:
    with open(run_dir / "metrics.csv") as f:
        return sum(float(r[key]) for r in csv.DictReader(f) if r.get(key))


def _bad_rows(tmp_path: Path, red: str) -> dict[str, dict]:
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"\x89PNG but not really" * 8)
    image = {"type": "image", "path": red}
    return {
        "missing": _row(BAD, [{"type": "image", "path": str(tmp_path / "missing.png")}, QUESTION]),
        "unreadable": _row(BAD, [{"type": "image", "path": str(garbage)}, QUESTION]),
        "placeholders": _row(BAD, [{"type": "image"}, {"type": "image"}, QUESTION], images=[red]),
        "url": _row(BAD, [{"type": "image", "url": "https://example.com/red.png"}, QUESTION]),
        # 16 images of 4 placeholder tokens each: 144 prompt tokens, data.max_seq_len=64.
        "too_long": _row(BAD, [image] * 16 + [QUESTION]),
    }


@pytest.mark.parametrize(
    "case,key,needles",
    [
        ("missing", "rollout/dropped_bad_image", ["missing.png", "not found"]),
        ("unreadable", "rollout/dropped_bad_image", ["garbage.png", "cannot be read"]),
        (
            "placeholders",
            "rollout/dropped_bad_image",
            ["2 image placeholders in the messages for 1 image in the row's images field"],
        ),
        ("url", "rollout/dropped_bad_image", ["https://example.com/red.png", "is a URL: runs are offline"]),
        ("too_long", "rollout/dropped_prompt_too_long", ["a prompt of 144 tokens", "data.max_seq_len=64"]),
    ],
)
def test_a_row_whose_image_cannot_be_used_is_dropped_with_one_line_and_the_run_goes_on(
    tmp_path, red, case, key, needles
):
    good = [_row(f"square{i}", [{"type": "image", "path": red}, QUESTION]) for i in range(4)]
    data = _write_rows(tmp_path / "rows.jsonl", [_bad_rows(tmp_path, red)[case], *good])
    proc, _ = _vlm_run(tmp_path, data)  # within the module's 120 s timeout: a bad row never waits
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "stopped: max_steps=2 reached" in proc.stdout
    named = [line for line in _warnings(proc) if f"id={BAD!r}" in line and "dropped" in line]
    assert len(named) == 1, _warnings(proc)  # sampled again each epoch, warned about once
    assert key in named[0] and all(n in named[0] for n in needles), (named[0], needles)
    assert _metric_total(tmp_path / "run", key) >= 2  # its G samples, each time it was sampled


def test_each_bad_row_is_named_once_and_the_runs_end_lists_them(tmp_path, red):
    """Two rows with bad images and good ones: each bad row named once (not one line for the kind of
    drop, which a good row's sampled placeholder could spend), the end's line and summary.json list both."""
    bad = _bad_rows(tmp_path, red)
    good = [_row(f"square{i}", [{"type": "image", "path": red}, QUESTION]) for i in range(4)]
    rows = [{**bad["missing"], "id": "bad_a"}, good[0], {**bad["url"], "id": "bad_b"}, *good[1:]]
    proc, _ = _vlm_run(tmp_path, _write_rows(tmp_path / "rows.jsonl", rows), "~callbacks.reward_filter")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = _warnings(proc)
    for row_id, index, needle in (("bad_a", 0, "not found"), ("bad_b", 2, "is a URL")):
        named = [w for w in warnings if f"row {index} (id={row_id!r}): its data cannot be used" in w]
        assert len(named) == 1 and needle in named[0], warnings
    [end] = [w for w in warnings if "row(s) had data that could not be used" in w]
    assert "- 2 row(s) had data" in end and "id='bad_a'" in end and "id='bad_b'" in end, end
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["bad_rows"]["count"] == 2
    assert [r["row"] for r in summary["bad_rows"]["first"]] == ["0 (id='bad_a')", "2 (id='bad_b')"]


def test_a_run_whose_every_row_is_bad_stops_with_one_message(tmp_path):
    rows = [_row(f"square{i}", [{"type": "image", "path": str(tmp_path / f"gone{i}.png")}, QUESTION]) for i in range(3)]
    proc, _ = _vlm_run(tmp_path, _write_rows(tmp_path / "rows.jsonl", rows))
    _assert_user_error(
        proc,
        "no prompt group was accepted in the last 100 rows sampled (guards.max_rows_without_progress=100)",
        "rollout/dropped_bad_image",
    )
    assert proc.stderr.count("error: ") == 1, proc.stderr
    assert "stopped: max_steps" not in proc.stdout
    warnings = _warnings(proc)  # each bad row named once, the first first
    assert "row 0 (id='square0')" in warnings[0] and "gone0.png' not found" in warnings[0], warnings
    assert sum("its data cannot be used" in w for w in warnings) == 3, warnings


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (
            ["sampler=vllm"],  # this machine has no torchvision (`test_check_sampler_fits_*` covers both cases)
            "model.vlm_arch",
            "vLLM's Qwen2-VL needs torchvision",
        ),
        (
            ["sampler=vllm_server", "model.vlm_arch=idefics3", "model.num_heads=2"]
            + ["offpolicy.synchronous=false", "offpolicy.partial_rollouts=true"],
            "offpolicy.partial_rollouts",
            "takes no images",
        ),
    ],
)
def test_a_vllm_sampler_that_cannot_take_the_vlms_images_is_refused_before_it_loads(tmp_path, overrides, field, words):
    proc, _ = _cli(tmp_path, "+experiment=vlm_shapes", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    message = _assert_user_error(proc, f"config field `{field}`", words)
    assert message.count("\n") == 1 and proc.stderr.count("error: ") == 1, proc.stderr  # one line
    assert "lit_grpo.models.load" not in proc.stdout  # no model was built


@pytest.mark.parametrize(
    "arch, torchvision, refused", [("qwen2_vl", False, True), ("qwen2_vl", True, False), ("idefics3", False, False)]
)
def test_check_sampler_fits_refuses_vllm_for_qwen2_vl_only_without_torchvision(
    monkeypatch, tmp_path, arch, torchvision, refused
):
    import importlib.util

    from conftest import compose_config

    from lit_grpo.config.checks import ConfigError
    from lit_grpo.config.run import check_sampler_fits, parse

    overrides = ["+experiment=vlm_shapes", "sampler=vllm", "model.vlm_arch=idefics3", "model.num_heads=2"]
    c = parse(compose_config(*overrides, output_dir=tmp_path))
    c.model.vlm_arch = arch
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if torchvision else None) if name == "torchvision" else real(name, *a),
    )
    if refused:
        with pytest.raises(ConfigError, match="model.vlm_arch.*needs torchvision"):
            check_sampler_fits(c)
    else:
        check_sampler_fits(c)


@pytest.mark.parametrize("data", ["task", "file"])
def test_a_text_policy_is_refused_rows_with_images_before_it_loads(tmp_path, red, data):
    overrides = ["+experiment=vlm_shapes", "model=tiny", f"hydra.run.dir={tmp_path / 'run'}"]
    if data == "file":
        rows = [_row("square0", [QUESTION]), _row(BAD, [{"type": "image", "path": red}, QUESTION])]
        overrides.append(f"data.path={_write_rows(tmp_path / 'rows.jsonl', rows)}")
    proc, _ = _cli(tmp_path, *overrides)
    where = f"data.path={tmp_path / 'rows.jsonl'}, row 1 (id={BAD!r})" if data == "file" else "row 0 (id='square0')"
    message = _assert_user_error(proc, "model.kind=tiny is a text policy", where, "model.kind=tiny_vlm")
    assert message.count("\n") == 1 and proc.stderr.count("error: ") == 1, proc.stderr
    assert "lit_grpo.models.load" not in proc.stdout


@pytest.mark.parametrize(
    "strategy, train_vision, refused", [("fsdp2", False, True), ("ddp", True, True), ("ddp", False, False)]
)
def test_rows_with_and_without_images_are_refused_where_ranks_must_run_the_tower_together(
    tmp_path, red, strategy, train_vision, refused
):
    """A rank whose batch holds no image would leave the others waiting in the tower's collectives."""
    from conftest import compose_config

    from lit_grpo.config.run import parse
    from lit_grpo.tasks import training_rows
    from lit_grpo.tasks.rows import RowPromptError

    rows = [_row("square0", [{"type": "image", "path": red}, QUESTION]), _row("text1", [QUESTION])]
    overrides = ["+experiment=vlm_shapes", f"trainer.strategy={strategy}", f"model.train_vision={train_vision}"]
    c = parse(compose_config(*overrides, output_dir=tmp_path))
    if refused:
        with pytest.raises(
            RowPromptError, match=rf"trainer.strategy={strategy}: .*row 1 \(id='text1'\) holds no image"
        ):
            training_rows(c, rows)
    else:
        assert training_rows(c, rows) == rows
