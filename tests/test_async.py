"""The off-policy scheduler: the gate bounds staleness; synchronous mode never overlaps."""

import asyncio
import csv
import time

import lightning as L
import pytest
from conftest import compose_config

from lit_grpo.loop.module import GRPOModule
from lit_grpo.rollouts import GroupSampler, OffPolicyScheduler, RowCursor
from lit_grpo.rollouts.datamodule import RolloutStream
from lit_grpo.train import train
from lit_grpo.types import RolloutSample

ROLLOUT_INTERVALS: list[tuple[float, float]] = []


def make_slow_rollout_fn(setup):
    """The default rollout plus a latency-bound environment step; records when each call ran."""
    from lit_grpo.rollouts.rollout import make_rollout_fn

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


def test_gate_oversamples_by_the_accept_rate():
    groups = GroupSampler(None, 4, max_seq_len=64, min_group_size=2, filters=[])
    p = OffPolicyScheduler(RowCursor([{}], 1, 0, False), groups, 2, max_head_offpolicy_versions=1, max_concurrency=64)
    p.accepted_samples, p.running, p.accept_rate = 8, 12, 0.5  # room 16 - 8 = 8: half of 16 in flight is expected
    assert p.can_admit()  # 0.5 · (12 + 4) = 8 <= 8
    p.running = 16
    assert not p.can_admit()
    p.accept_rate = 0.01  # a filter that rejects nearly everything: at most 4× the room is in flight
    p.running = 28
    assert p.can_admit()  # 0.25 · (28 + 4) = 8
    p.running = 32
    assert not p.can_admit()
    p.close()


def _half_kept_rows_fn(latency_s: float, starts: dict[int, float]):
    """A latency-bound rollout; the filter of `_half_kept` keeps the groups of even rows only."""

    async def rollout_fn(row):
        starts.setdefault(row["id"], time.perf_counter())
        await asyncio.sleep(latency_s)
        return RolloutSample(
            tokens=[1, 100 + row["id"], 2], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1], reward=1.0
        )

    return rollout_fn


def _half_kept(group) -> bool:
    return group.row["id"] % 2 == 0


def test_o1_overlaps_the_next_steps_rollouts_with_training():
    """Rollouts longer than a training step, half the groups filtered out: with O = 1 the next
    step's rows are sampled while this step trains (some of them train at offset 1), and no
    group trains more than one version after it was sampled."""
    latency_s, train_s, steps, P, G = 0.2, 0.1, 10, 4, 2
    starts: dict[int, float] = {}
    groups = GroupSampler(
        _half_kept_rows_fn(latency_s, starts), G, max_seq_len=64, min_group_size=2, filters=[_half_kept]
    )
    scheduler = OffPolicyScheduler(
        RowCursor([{"id": i} for i in range(400)], 1, 0, False),
        groups,
        P,
        max_head_offpolicy_versions=1,
        max_concurrency=256,
    )
    trained: list[list[int]] = []
    windows: list[tuple[float, float]] = []
    offsets: list[list[int]] = []
    gate_waits: list[float] = []
    began = time.perf_counter()
    try:
        for batch in RolloutStream(scheduler, groups, max_steps=steps, pad_id=0):
            gate_waits.append(batch.record.timings["perf/sampler_wait_s"])
            start = time.perf_counter()
            time.sleep(train_s)  # the training step
            windows.append((start, time.perf_counter()))
            trained.append([int(t) - 100 for t in batch.tokens_BT[::G, 1]])
            offsets.append(batch.record.version_offsets)
            scheduler.advance_version()  # the weight sync at the end of the step
    finally:
        scheduler.close()
    assert max(max(o) for o in offsets) <= 1
    for k in range(1, steps - 1):  # some of step k+1's rows started before step k's training ended
        assert min(starts[i] for i in trained[k + 1]) < windows[k][1], k
        assert 1 in offsets[k + 1]
    # The sampler's gate waits are counted once: all steps' together fit in the run's time.
    assert 0 < sum(gate_waits) <= time.perf_counter() - began
    # How much that saves is measured by `make bench-async`, not asserted here.


@pytest.mark.parametrize("offpolicy", [0, 1, 2])
def test_version_offset_never_exceeds_the_bound(offpolicy, tmp_path):
    cfg = compose_config(
        "+experiment=arithmetic",
        "offpolicy.synchronous=false",
        f"offpolicy.max_lag={offpolicy}",
        "max_steps=12",
        "optim.lr_decay=constant",
        "rollout.factory=test_async:make_slow_rollout_fn",
        "trainer.enable_progress_bar=false",
        "+callbacks.slow._target_=test_async.SlowTrainer",
        output_dir=tmp_path,
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


def test_a_straggler_past_its_budget_is_sampled_again_not_trained_late():
    """Row 0's first rollout outlasts several steps of fast rows: accepted then, it would train
    more than O = 1 versions after it was sampled. It is sampled again instead, and every row
    still trains exactly once."""
    calls: dict[int, int] = {}

    async def rollout_fn(row):
        calls[row["id"]] = calls.get(row["id"], 0) + 1
        await asyncio.sleep(0.5 if row["id"] == 0 and calls[0] <= 2 else 0.005)  # both samples of its first group
        return RolloutSample(
            tokens=[1, 100 + row["id"], 2], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1], reward=float(row["id"] % 2)
        )

    G = 2
    groups = GroupSampler(rollout_fn, G, max_seq_len=64, min_group_size=2, filters=[])
    scheduler = OffPolicyScheduler(
        RowCursor([{"id": i} for i in range(8)], 1, 0, False),
        groups,
        1,
        max_head_offpolicy_versions=1,
        max_concurrency=64,
    )
    trained, offsets, stale = [], [], 0
    try:
        for batch in RolloutStream(scheduler, groups, max_steps=-1, pad_id=0):
            trained += [int(t) - 100 for t in batch.tokens_BT[::G, 1]]
            offsets += batch.record.version_offsets
            stale += batch.record.counts.get("rollout/stale_groups", 0)
            scheduler.advance_version()
    finally:
        scheduler.close()
    assert sorted(trained) == list(range(8)) and max(offsets) <= 1
    assert stale == 1 and calls[0] == 2 * G


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
    train(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=8",
            "optim.lr_decay=constant",
            "rollout.factory=test_async:make_slow_rollout_fn",
            "trainer.enable_progress_bar=false",
            *overrides,
            output_dir=tmp_path,
        )
    )
    return sum(1 for a, b in ROLLOUT_INTERVALS for s, e in train_windows if a < e and s < b)


def test_synchronous_training_never_overlaps(monkeypatch, tmp_path):
    assert _overlap_count(monkeypatch, tmp_path / "sync", "offpolicy.synchronous=true") == 0
    assert _overlap_count(monkeypatch, tmp_path / "async", "offpolicy.synchronous=false", "offpolicy.max_lag=1") > 0


def test_rollout_failures_in_async_mode_stop_training(tmp_path):
    from lit_grpo.rollouts.checks import RolloutCircuitOpen

    with pytest.raises(RolloutCircuitOpen):
        train(
            compose_config(
                "+experiment=arithmetic",
                "offpolicy.synchronous=false",
                "max_steps=3",
                "optim.lr_decay=constant",
                "rollout.factory=test_async:make_failing_rollout_fn",
                "trainer.enable_progress_bar=false",
                output_dir=tmp_path,
            )
        )


def make_failing_rollout_fn(setup):
    async def rollout_fn(row):
        raise ConnectionError("environment is down")

    return rollout_fn


def test_interval_zero_keeps_admitting_rows(tmp_path):
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "offpolicy.synchronous=false",
            "offpolicy.weight_sync_interval=0",
            "max_steps=5",
            "optim.lr_decay=constant",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 5


def _straggler_run(versions_of, *, offpolicy: int, max_rollout_versions: int = 0):
    """Row 0's first group outlasts several steps of fast rows; every sample reports its tokens'
    versions as `versions_of(version at the call, version at the end)` says. Returns the rows
    trained, the version offsets and the counts."""
    calls: dict[int, int] = {}
    box: dict = {}

    async def rollout_fn(row):
        calls[row["id"]] = calls.get(row["id"], 0) + 1
        began = box["scheduler"].version
        await asyncio.sleep(0.5 if row["id"] == 0 and calls[0] <= 2 else 0.005)
        return RolloutSample(
            tokens=[1, 100 + row["id"], 2],
            logprobs=[0.0, -1.0, -1.0],
            loss_mask=[0, 1, 1],
            reward=float(row["id"] % 2),
            token_versions=[-1, *versions_of(began, box["scheduler"].version)],
        )

    groups = GroupSampler(rollout_fn, 2, max_seq_len=64, min_group_size=2, filters=[])
    scheduler = box["scheduler"] = OffPolicyScheduler(
        RowCursor([{"id": i} for i in range(8)], 1, 0, False),
        groups,
        1,
        max_head_offpolicy_versions=offpolicy,
        max_concurrency=64,
        max_rollout_versions=max_rollout_versions,
    )
    trained, offsets, counts = [], [], {}
    try:
        for batch in RolloutStream(scheduler, groups, max_steps=-1, pad_id=0):
            trained += [int(t) - 100 for t in batch.tokens_BT[::2, 1]]
            offsets += batch.record.version_offsets
            for key, value in batch.record.counts.items():
                counts[key] = counts.get(key, 0) + value
            scheduler.advance_version()
    finally:
        scheduler.close()
    return trained, offsets, counts, calls


@pytest.mark.timeout(60)
def test_a_group_counts_at_its_oldest_tokens_version():
    """The straggler's tokens were all generated at the end (its requests waited): its group counts
    at that version, so it trains in time, not as stale; one whose first token came at the call is
    stale, as without versions."""
    trained, offsets, counts, calls = _straggler_run(lambda began, now: [now, now], offpolicy=1)
    assert sorted(trained) == list(range(8)) and max(offsets) <= 1
    assert counts.get("rollout/stale_groups", 0) == 0 and calls[0] == 2
    trained, offsets, counts, calls = _straggler_run(lambda began, now: [began, now], offpolicy=1)
    assert sorted(trained) == list(range(8)) and max(offsets) <= 1
    assert counts.get("rollout/stale_groups", 0) == 1 and calls[0] == 4


@pytest.mark.timeout(60)
def test_max_rollout_versions_samples_a_long_spanning_group_again():
    """O = 20 lets the straggler train, but its tokens span more than max_rollout_versions = 2
    versions: its row is sampled again (`rollout/span_groups`), and every row trains once."""
    trained, offsets, counts, calls = _straggler_run(
        lambda began, now: [began, now], offpolicy=20, max_rollout_versions=2
    )
    assert sorted(trained) == list(range(8))
    assert counts.get("rollout/span_groups", 0) == 1 and calls[0] == 4
    trained, _, counts, calls = _straggler_run(lambda began, now: [began, now], offpolicy=20)
    assert sorted(trained) == list(range(8)) and not counts.get("rollout/span_groups") and calls[0] == 2


@pytest.mark.timeout(240)
def test_partial_rollouts_on_the_hf_sampler_count_from_the_resumed_version(tmp_path):
    """With the hf sampler each token carries its generate call's version; a resumed run's sampler
    counts from the saved version, not from 0 (else every group would look stale and be resampled)."""
    from conftest import trained_steps

    common = [
        "+experiment=arithmetic",
        "offpolicy.synchronous=false",
        "offpolicy.max_lag=1",
        "offpolicy.partial_rollouts=true",
        "checkpoint.save_interval=2",
        "optim.lr_decay=constant",
        "trainer.enable_progress_bar=false",
        "output_model_id=null",
    ]
    train(compose_config(*common, "max_steps=4", output_dir=tmp_path))
    summary = train(compose_config(*common, "max_steps=8", "resume=auto", output_dir=tmp_path))
    assert summary["steps"] == 8
    steps = trained_steps(tmp_path)
    resumed = [s for s in steps if s["policy/version"] >= 4]
    assert len(resumed) >= 4
    assert all(s["async/version_offset_max"] <= 1 for s in steps)
    assert all(s.get("async/spans_a_sync", -1.0) == 0.0 for s in steps)  # one-token completions: one call each
    assert sum(s.get("rollout/stale_groups", 0.0) for s in resumed) <= 2
