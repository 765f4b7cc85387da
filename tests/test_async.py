"""The off-policy scheduler: the gate bounds staleness; synchronous mode never overlaps."""

import asyncio
import csv
import time

import lightning as L
import pytest

from lit_grpo.module import GRPOModule
from lit_grpo.rollouts import GroupSampler, OffPolicyScheduler, RowCursor
from lit_grpo.train import train

from conftest import compose_config

ROLLOUT_INTERVALS: list[tuple[float, float]] = []


def make_slow_rollout_fn(setup):
    """The default rollout plus a latency-bound environment step; records when each call ran."""
    from lit_grpo.rollout import make_rollout_fn

    inner = make_rollout_fn(setup)

    async def rollout_fn(row):
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        sample = await inner(row)
        ROLLOUT_INTERVALS.append((start, time.perf_counter()))
        return sample

    return rollout_fn


class SlowTrainer(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.05)


def test_gate_arithmetic_by_hand():
    groups = GroupSampler(None, 4, max_seq_len=64, min_group_size=2, filters=[])
    p = OffPolicyScheduler(RowCursor([{}], 1, 0, False), groups, 2, max_head_offpolicy_versions=1, max_concurrency=64)
    # B = 2·4 = 8; O = 1, version 0: budget (1 + 0 + 1)·8 = 16 samples.
    p.accepted_samples, p.running = 8, 4
    assert p.can_admit()  # 16 - 12 = 4 >= G
    p.running = 8
    assert not p.can_admit()  # 16 - 16 = 0 < G
    p.version = 1
    assert p.can_admit()  # 24 - 16 = 8
    p.max_concurrency = 8
    assert not p.can_admit()  # the concurrency cap: 8 in flight already
    p.close()


@pytest.mark.parametrize("offpolicy", [0, 1, 2])
def test_version_offset_never_exceeds_the_bound(offpolicy, tmp_path):
    cfg = compose_config(
        "+experiment=arithmetic", "synchronous_training=false", f"max_head_offpolicy_versions={offpolicy}", "max_steps=12",
        "lr_decay=constant", "rollout.factory=test_async:make_slow_rollout_fn", "trainer.enable_progress_bar=false",
        "+callbacks.slow._target_=test_async.SlowTrainer", output_dir=tmp_path,
    )
    train(cfg)
    steps = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader((tmp_path / "metrics.csv").open())]
    assert len(steps) == 12
    offsets = [s["async/version_offset_max"] for s in steps]
    assert max(offsets) <= offpolicy
    if offpolicy == 0:
        assert set(offsets) == {0.0}
    else:
        assert max(offsets) == offpolicy  # with a slow trainer the budget is used
        assert max(s["perf/overlap_ratio"] for s in steps) > 0.5


def _overlap_count(monkeypatch, tmp_path, *overrides):
    train_windows = []
    real_step = GRPOModule._optimizer_step

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = real_step(self, *args, **kwargs)
        train_windows.append((start, time.perf_counter()))
        return out

    monkeypatch.setattr(GRPOModule, "_optimizer_step", timed)
    ROLLOUT_INTERVALS.clear()
    train(compose_config(
        "+experiment=arithmetic", "max_steps=8", "lr_decay=constant", "rollout.factory=test_async:make_slow_rollout_fn",
        "trainer.enable_progress_bar=false", *overrides, output_dir=tmp_path,
    ))
    return sum(1 for a, b in ROLLOUT_INTERVALS for s, e in train_windows if a < e and s < b)


def test_synchronous_training_never_overlaps(monkeypatch, tmp_path):
    assert _overlap_count(monkeypatch, tmp_path / "sync", "synchronous_training=true") == 0
    assert _overlap_count(monkeypatch, tmp_path / "async", "synchronous_training=false", "max_head_offpolicy_versions=1") > 0


def test_rollout_failures_in_async_mode_stop_training(tmp_path):
    from lit_grpo.rollouts.checks import RolloutCircuitOpen

    with pytest.raises(RolloutCircuitOpen):
        train(compose_config(
            "+experiment=arithmetic", "synchronous_training=false", "max_steps=3", "lr_decay=constant",
            "rollout.factory=test_async:make_failing_rollout_fn", "trainer.enable_progress_bar=false", output_dir=tmp_path,
        ))


def make_failing_rollout_fn(setup):
    async def rollout_fn(row):
        raise ConnectionError("environment is down")

    return rollout_fn


def test_interval_zero_keeps_admitting_rows(tmp_path):
    summary = train(compose_config(
        "+experiment=arithmetic", "synchronous_training=false", "weight_sync_interval=0", "max_steps=5",
        "lr_decay=constant", "trainer.enable_progress_bar=false", output_dir=tmp_path,
    ))
    assert summary["steps"] == 5
