"""Console hygiene of the command line: each line once (Lightning's handler and Hydra's used to
print every INFO line twice), no third-party advertisement, and the run's real stop reason as its
last line (not Lightning's "`Trainer.fit` stopped: `max_epochs=1` reached")."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lit_grpo.run.console import stop_reason, tidy_lightning_logging

REPO = Path(__file__).resolve().parents[1]
HYDRA_LINE = re.compile(r"^\[[\d\-: ,]+\]\[([\w.]+)\]\[(\w+)\] - (.*)$")  # [time][logger][LEVEL] - message
PLAIN_LINE = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL): (.*)$")  # Lightning's own handler


def run(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_grpo.train",
            "+experiment=arithmetic",
            "trainer.enable_progress_bar=false",
            *overrides,
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def messages(lines: list[str]) -> list[str]:
    """Each line's message, whichever handler printed it (time stamps and prefixes removed)."""
    out = []
    for line in lines:
        if m := HYDRA_LINE.match(line):
            out.append(m.group(3))
        elif m := PLAIN_LINE.match(line):
            out.append(m.group(1))
        else:
            out.append(line)
    return out


def assert_tidy(lines: list[str]) -> None:
    repeated = {m: n for m, n in Counter(messages(lines)).items() if n > 1}
    assert not repeated, f"printed more than once: {repeated}\n" + "\n".join(lines)
    text = "\n".join(lines)
    for noise in ("litlogger", "litmodels", "Tip:", "max_epochs", "Writing model shards"):
        assert noise not in text, text


@pytest.mark.timeout(300)
def test_a_run_that_reaches_max_steps_prints_each_line_once_and_says_so_last(tmp_path):
    proc, lines = run(tmp_path, "max_steps=3")
    assert_tidy(lines)
    assert proc.stdout.splitlines()[-1].endswith("][INFO] - stopped: max_steps=3 reached"), proc.stdout
    assert "GPU available" in proc.stdout  # Lightning's own lines still show, once, through Hydra's handler


@pytest.mark.timeout(300)
def test_a_run_whose_rows_ran_out_says_so_last(tmp_path):
    proc, lines = run(tmp_path, "task.num_rows=16", "data.epochs=1", "max_steps=5", "~callbacks.reward_filter")
    assert_tidy(lines)
    assert proc.stdout.splitlines()[-1].endswith("stopped: the rows ran out after 2 of max_steps=5 steps"), proc.stdout


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (
            dict(steps=20, max_steps=20, rows_exhausted=False, signum=None, fast_dev_run=False),
            "stopped: max_steps=20 reached",
        ),
        (
            dict(steps=7, max_steps=20, rows_exhausted=True, signum=None, fast_dev_run=False),
            "stopped: the rows ran out after 7 of max_steps=20 steps",
        ),
        (
            dict(steps=7, max_steps=-1, rows_exhausted=False, signum=None, fast_dev_run=False),
            "stopped: the rows are used up after 7 steps",
        ),
        (
            dict(steps=4, max_steps=20, rows_exhausted=False, signum=15, fast_dev_run=False),
            "stopped: SIGTERM after 4 steps",
        ),
        (
            dict(steps=1, max_steps=20, rows_exhausted=False, signum=None, fast_dev_run=True),
            "stopped: trainer.fast_dev_run (1 step)",
        ),
    ],
)
def test_stop_reasons(kwargs, said):
    assert stop_reason(**kwargs) == said


def test_lightning_lines_go_through_the_root_handlers_once(monkeypatch):
    import lightning.pytorch  # noqa: F401  (its loggers exist)

    root, handler = logging.getLogger(), logging.StreamHandler()
    monkeypatch.setattr(root, "handlers", [handler])
    lightning_logger = logging.getLogger("lightning")
    lightning_console = logging.StreamHandler()
    monkeypatch.setattr(lightning_logger, "handlers", [lightning_console])
    for name in ("lightning.pytorch", "lightning.fabric"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", False)
    tidy_lightning_logging()
    tidy_lightning_logging()  # idempotent
    assert lightning_logger.handlers == [] and logging.getLogger("lightning.pytorch").propagate
    seen = []
    monkeypatch.setattr(handler, "emit", lambda record: seen.append(record.getMessage()))
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    rank_zero_info("💡 Tip: an advertisement")
    rank_zero_info("`Trainer.fit` stopped: `max_epochs=1` reached.")
    rank_zero_info("GPU available: False, used: False")
    assert seen == ["GPU available: False, used: False"]
