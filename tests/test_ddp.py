"""Data parallelism on 2 CPU processes (gloo): each rank samples its own share of the rows, the
gradient is the one of a single process on the union of the batches, the logged metrics pool the
ranks, a step without a learning signal is skipped by both ranks together (and one with a signal on
one rank only is taken by both), and a killed DDP run resumes bit-identical to an uninterrupted one."""

from __future__ import annotations

import csv
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import run_test_script
from ddp_grad_probe import (
    assert_images_reached_the_tower,
    assert_ranks_equal_the_union,
    assert_rows_left_out_keep_the_union_gradient,
    run_probe,
)
from test_checkpoint import assert_bit_identical, run_cli, tensors

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
DDP = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _rows(run_dir: Path, rank: int) -> Counter:
    path = run_dir / f"rows_rank{rank}.txt"
    return Counter(line.split(" ", 1)[1] for line in path.read_text().splitlines()) if path.exists() else Counter()


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader((run_dir / "metrics.csv").open())]


def test_ranks_sample_disjoint_rows_that_together_are_a_single_process_run_with_twice_the_groups(tmp_path):
    common = [
        "callbacks=none",
        "max_steps=3",
        "offpolicy.synchronous=true",
        "data.completions_per_prompt=2",
        "task.num_rows=64",
        "task.max_operand=300",
        "task.max_answer=600",  # distinct prompts
        "rollout.factory=ddp_rollouts:make_recording_rollout_fn",
        "output_model_id=null",
    ]
    two, one = tmp_path / "two", tmp_path / "one"
    for run_dir, extra in ((two, [*DDP, "data.prompt_groups_per_step=2"]), (one, ["data.prompt_groups_per_step=4"])):
        run_dir.mkdir()
        proc = run_cli(run_dir, *common, *extra, f"+rollout.extras.record_dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]

    rank0, rank1, single = _rows(two, 0), _rows(two, 1), _rows(one, 0)
    assert len(set(single)) == 12 and set(single.values()) == {2}  # 3 steps × 4 rows, G = 2 calls each
    assert not set(rank0) & set(rank1), "the ranks sampled the same rows"
    assert rank0 + rank1 == single
    # Both ranks trained every step; what was logged is pooled: rank r's reward is r.
    steps = _metrics(two)
    assert len(steps) == 3
    for s in steps:
        assert s["reward/mean"] == 0.5 and s["rollout/groups_accepted"] == 4


@pytest.mark.parametrize("sizes", ["4,6"])
def test_two_process_gradient_equals_one_process_gradient_on_the_union(sizes, tmp_path):
    for devices in (1, 2):
        run_probe(tmp_path, devices, sizes)
    assert_ranks_equal_the_union(tmp_path, "ddp")


# Rank 0's 4 rows all have advantage 0 and 4 of rank 1's 6 (β 0): each rank leaves out its own rows
# of advantage 0 (rank 0 keeps one, for the all-reduce), and the gradient is still the union's.
def test_two_process_gradient_with_rows_left_out_equals_one_process_gradient_on_the_union(tmp_path):
    assert_rows_left_out_keep_the_union_gradient(tmp_path, "ddp")


@pytest.mark.parametrize(  # checkpointed: nightly (CI's 30 minutes)
    "overrides",
    [[], ["text_every=2"], pytest.param(["model.gradient_checkpointing=true"], marks=pytest.mark.nightly)],
    ids=["plain", "text_rows", "checkpointed"],
)
def test_two_process_gradient_with_images_equals_one_process_gradient_on_the_union(overrides, tmp_path):
    """A vision-language policy: rows with images of different sizes (4, 2 or 1 image tokens), each
    rank's images sliced into micro-batches of 3 rows, KL on so the reference's forward takes them too.
    `text_rows`: every other row holds no image, batched with the others (rank 0's last micro-batch
    is a text row alone)."""
    for devices in (1, 2):
        run_probe(tmp_path, devices, "4,6", "ddp", "0.01", "grads", "model=tiny_vlm", *overrides)
    assert_ranks_equal_the_union(tmp_path, "ddp")
    assert_images_reached_the_tower(tmp_path, "ddp")
    if "model.gradient_checkpointing=true" in overrides:  # the decoder layers were recomputed on every rank
        assert all(torch.load(p) > 0 for p in tmp_path.glob("recomputes_ddp_*.pt"))


def test_both_ranks_step_when_either_has_a_signal_and_skip_together_when_neither_has(tmp_path):
    # tests/ddp_signal_probe.py, step 1: rank 0's advantages are all 0, rank 1's are not; step 2: all
    # 0 on both. A rank deciding alone would skip step 1 on rank 0 and leave the ranks' weights apart.
    run_test_script("ddp_signal_probe.py", str(tmp_path), cwd=tmp_path)
    ranks = [torch.load(tmp_path / f"signal_rank{r}.pt") for r in (0, 1)]
    (before, after_1, after_2), other = ranks[0]["weights"], ranks[1]["weights"]

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    assert all(same(mine, theirs) for mine, theirs in zip((before, after_1, after_2), other))  # the ranks agree
    assert not same(before, after_1)  # step 1 taken on both: rank 1's signal is the step's
    assert same(after_1, after_2)  # step 2 skipped on both
    for rank in ranks:  # every rank logs the merged metrics
        assert [m["train/skipped_no_signal"] for m in rank["metrics"]] == [0.0, 1.0]
        assert [m["train/skipped_nonfinite"] for m in rank["metrics"]] == [0.0, 0.0]


def test_a_killed_ddp_run_resumes_bit_identical(tmp_path):
    ddp = [*DDP, "max_steps=6", "checkpoint.save_interval=2"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = run_cli(whole, *ddp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step4 = whole / "checkpoints" / "step_00000004"
    assert {"__0_0.distcp", "__1_0.distcp", "trainer_state_rank0.pt", "trainer_state_rank1.pt"} <= {
        p.name for p in step4.iterdir()
    }

    proc = run_cli(killed, *ddp, "+callbacks.kill={_target_:fault_injection.KillAfterStep,step:5}")
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = run_cli(killed, *ddp, "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000004" in (killed / "summary.json").read_text()
    assert_bit_identical(tensors(whole / "final_model"), tensors(killed / "final_model"))
    assert [s["reward/mean"] for s in _metrics(whole)] == [s["reward/mean"] for s in _metrics(killed)]


def test_a_two_rank_lora_run_resumes_bit_identical(tmp_path):
    """LoRA under DDP: only the adapters are synced and saved; resuming the step-2 checkpoint of a
    4-step run (its later checkpoint and outputs removed) ends with the same merged model."""
    lora = [*DDP, "model.lora.rank=4", "learning_rate=1e-2", "max_steps=4", "checkpoint.save_interval=2"]
    whole, again = tmp_path / "whole", tmp_path / "again"
    proc = run_cli(whole, *lora)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(whole, again)
    shutil.rmtree(again / "checkpoints" / "step_00000004")
    shutil.rmtree(again / "final_model")
    proc = run_cli(again, *lora, "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000002" in (again / "summary.json").read_text()
    assert_bit_identical(tensors(whole / "final_model"), tensors(again / "final_model"))
    assert [s["reward/mean"] for s in _metrics(whole)] == [s["reward/mean"] for s in _metrics(again)]
