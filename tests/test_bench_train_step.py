"""The pure helpers of benchmarks/train_step_trl.py (lit_grpo vs TRL, one optimizer step): the ragged
lengths from a seed, the padding fraction of a step's forwards, the memory guard and how a child's
outcome is read. Fast, no TRL, no model."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not in the installed package
from benchmarks.train_step_trl import (  # noqa: E402
    GROUP,
    RESULT_PREFIX,
    GuardedRun,
    classify_outcome,
    completion_lengths,
    forward_shapes,
    micro_batch_rows,
    padding_fraction,
    run_capped,
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
