"""The pure helpers of benchmarks/vs_trl/train_step.py (lit_grpo vs TRL, one optimizer step): the ragged
lengths from a seed, the padding fraction of a step's forwards, the memory guard and how a child's
outcome is read. Fast, no TRL, no model."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not in the installed package
from benchmarks.memory.cap import GuardedRun, run_capped  # noqa: E402
from benchmarks.vs_trl.train_step import (  # noqa: E402
    GROUP,
    RESULT_PREFIX,
    child_command,
    classify_outcome,
    completion_lengths,
    forward_shapes,
    micro_batch_rows,
    padding_fraction,
    parse_args,
    report,
)


def test_completion_lengths_are_seeded_ragged_and_within_a_quarter_to_the_whole_maximum():
    lengths = completion_lengths(1024, GROUP, seed=0)
    assert lengths == completion_lengths(1024, GROUP, seed=0)  # the same on every run (and interpreter)
    assert lengths != completion_lengths(1024, GROUP, seed=1)
    assert len(lengths) == GROUP and len(set(lengths)) > 1
    assert all(256 <= n <= 1024 for n in lengths)
    many = completion_lengths(10, 2000, seed=3)
    assert min(many) == math.ceil(2.5) and max(many) == 10  # both ends drawn: [ceil(max / 4), max]
    assert completion_lengths(1, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        completion_lengths(0)


def test_micro_batches_split_the_rows_in_order_and_refuse_a_size_that_does_not_divide_them():
    assert micro_batch_rows(8, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert micro_batch_rows(8, 8) == micro_batch_rows(8, 0) == [range(0, 8)]
    with pytest.raises(ValueError, match="must divide"):
        micro_batch_rows(8, 3)


def test_padding_fraction_counts_every_forward_padded_to_the_batch_longest_and_none_when_packed():
    seq = [10, 4, 6, 8]  # prompt + completion tokens of each row
    assert forward_shapes(seq, 2, packed=False) == [(2, 10), (2, 10)]  # the batch's longest, not each micro's
    assert padding_fraction(forward_shapes(seq, 2, packed=False), sum(seq)) == pytest.approx(12 / 40)
    assert padding_fraction(forward_shapes(seq, 0, packed=False), sum(seq)) == pytest.approx(12 / 40)
    assert forward_shapes(seq, 2, packed=True) == [(1, 14), (1, 14)]
    assert padding_fraction(forward_shapes(seq, 2, packed=True), sum(seq)) == 0.0
    with pytest.raises(ValueError):
        padding_fraction([(1, 5)], 6)  # more tokens than slots: a wrong count


def _run(**fields) -> GuardedRun:
    return GuardedRun(**{"returncode": 0, "stdout": "", "stderr": "", "over_cap": False, "guard": "watchdog", **fields})


def test_an_outcome_is_the_result_line_or_says_why_there_is_none():
    result = {"side": "lit", "step_s": 1.5}
    ok = classify_outcome(_run(stdout="noise\n" + RESULT_PREFIX + json.dumps(result) + "\n"), 20)
    assert ok == {"status": "ok", **result}
    capped = classify_outcome(_run(returncode=-9, over_cap=True), 20)
    assert capped["status"] == "over_cap" and capped["note"] == "did not fit in 20 GiB"
    oom = classify_outcome(_run(returncode=1, stderr="RuntimeError: DefaultCPUAllocator: can't allocate memory"), 0.5)
    assert oom["status"] == "over_cap" and oom["note"] == "did not fit in 0.5 GiB"
    gpu = classify_outcome(_run(returncode=1, stderr="torch.OutOfMemoryError: CUDA out of memory."), 20)
    assert gpu["note"] == "did not fit in the GPU's memory"
    assert classify_outcome(_run(returncode=-9, timed_out=True), 20)["status"] == "timeout"
    failed = classify_outcome(_run(returncode=2, stderr="Traceback: boom"), 20)
    assert failed["status"] == "failed" and failed["note"] == "exit 2" and "boom" in failed["stderr_tail"]
    # A result line from a child that then failed is not a result.
    assert classify_outcome(_run(returncode=1, stdout=RESULT_PREFIX + "{}"), 20)["status"] == "failed"


def test_the_guard_stops_a_child_over_its_cap_and_lets_one_under_it_finish():
    hog = "x = bytearray(600 * 2**20); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(30)"
    over = run_capped([sys.executable, "-c", hog], cap_bytes=200 * 2**20, timeout_s=60)
    assert over.over_cap and over.returncode != 0 and not over.timed_out
    assert classify_outcome(over, 0.2)["note"] == "did not fit in 0.2 GiB"
    under = run_capped([sys.executable, "-c", f"print({RESULT_PREFIX!r} + '{{}}')"], 2**30, timeout_s=60)
    assert not under.over_cap and under.returncode == 0 and classify_outcome(under, 1)["status"] == "ok"


def test_a_child_gets_the_case_and_the_shapes_and_the_packing_choice():
    args = parse_args(["--layers", "3", "--micro-batch", "2", "--no-padding-free", "--hidden", "64"])
    command = child_command("py", "trl", 1024, args)
    assert command[:6] == ["py", "-m", "benchmarks.vs_trl.train_step", "--side", "trl", "--max-lengths"]
    assert command[6] == "1024" and "--no-padding-free" in command
    flags = dict(zip(command[7::2], command[8::2]))
    assert flags["--layers"] == "3" and flags["--micro-batch"] == "2" and flags["--hidden"] == "64"
    assert flags["--vocab"] == "151936" and flags["--device"] == "cpu"
    assert "--padding-free" in child_command("py", "lit", 256, parse_args([]))


def _ok(side: str, rss: float, extra: float, step_s: float, packed: bool = False) -> dict:
    return {
        "status": "ok", "side": side, "lengths": [300, 256], "padding_free": packed, "peak_rss_MB": rss,
        "step_extra_MB": extra, "step_s": step_s, "padding": 0.0 if packed else 0.25, "losses": [0.5],
        "gradient_checkpointing": True, "threads": 2, "versions": {"torch": "t"},
    }  # fmt: skip


def test_the_table_takes_medians_gives_the_ratios_and_names_a_case_that_did_not_fit():
    args = parse_args(["--repeats", "3"])
    did_not_fit = {"status": "over_cap", "note": "did not fit in 20 GiB"}
    runs = {
        "lit": [_ok("lit", 1000, 100, 2.0, True), _ok("lit", 3000, 300, 4.0, True), _ok("lit", 2000, 200, 3.0, True)],
        "trl": [_ok("trl", 4000, 400, 6.0), did_not_fit, _ok("trl", 4000, 400, 6.0)],
    }
    text = "\n".join(report(1024, runs, args))
    assert "lit_grpo packing: on" in text and "completions [300, 256]" in text
    lit_row = next(line for line in text.splitlines() if line.startswith("lit_grpo "))
    assert lit_row.split()[1:5] == ["2000", "200", "3.00", "0.000"]  # medians of the three processes
    assert "did not fit in 20 GiB" in next(line for line in text.splitlines() if line.startswith("trl "))
    assert "step time 0.50x, peak_rss_MB 0.50x, step_extra_MB 0.50x" in text
    nothing = report(4096, {"lit": [_ok("lit", 1, 1, 1.0)], "trl": [did_not_fit]}, args)
    assert not any("x, " in line for line in nothing)  # no ratio without both sides
    assert "trl       did not fit in 20 GiB" in nothing
