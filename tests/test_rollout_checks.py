"""Malformed samples are dropped and counted by reason; failing rollouts trip the circuit breaker."""

import math

import pytest

from lit_grpo.data import RolloutStream
from lit_grpo.rollouts import GroupSampler, RowCursor, SynchronousScheduler, rollout_metrics
from lit_grpo.rollout import load_rollout_factory
from lit_grpo.rollouts.checks import CircuitBreaker, RolloutCircuitOpen, sample_problem
from lit_grpo.types import RolloutSample

GOOD = dict(tokens=[1, 2, 3], logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], reward=1.0)


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(logprobs=[0.0, -0.1]), "length_mismatch"),
        (dict(loss_mask=[0, 0, 0]), "empty_mask"),
        (dict(reward=math.nan), "nonfinite_reward"),
        (dict(reward=math.inf), "nonfinite_reward"),
        (dict(tokens=[1] * 9, logprobs=[0.0] * 9, loss_mask=[1] * 9), "too_long"),
    ],
)
def test_each_bad_sample_kind_is_named(change, reason):
    assert sample_problem(RolloutSample(**GOOD), max_seq_len=8) is None
    assert sample_problem(RolloutSample(**{**GOOD, **change}), max_seq_len=8) == reason
    assert sample_problem({"tokens": [1]}, max_seq_len=8) == "not_a_sample"


def _stream(rows, rollout_fn, *, G, max_seq_len=64, P=2):
    groups = GroupSampler(rollout_fn, G, max_seq_len=max_seq_len, min_group_size=2, filters=[])
    scheduler = SynchronousScheduler(RowCursor(rows, 1, 0, False), groups, P, max_concurrency=256)
    return iter(RolloutStream(scheduler, groups, max_steps=-1, advantage_scale="std", pad_id=0))


def test_pipeline_drops_and_counts_bad_samples_and_small_groups():
    # Row 0: one good sample, two bad ones -> group of 1 < min_group_size, dropped.
    # Row 1: rewards 1, 0 plus a NaN reward -> a group of 2 that trains.
    bad = {0: [GOOD, {**GOOD, "loss_mask": [0, 0, 0]}, {**GOOD, "tokens": [1] * 20, "logprobs": [0.0] * 20, "loss_mask": [1] * 20}],
           1: [GOOD, {**GOOD, "reward": 0.0}, {**GOOD, "reward": math.nan}]}
    calls = {0: 0, 1: 0}

    async def rollout_fn(row):
        k = calls[row["id"]]
        calls[row["id"]] += 1
        return RolloutSample(**bad[row["id"]][k])

    batch = next(_stream([{"id": 0}, {"id": 1}], rollout_fn, G=3, max_seq_len=8))
    metrics = rollout_metrics([batch.record])
    assert batch.num_sequences == 2 and batch.rewards_B.tolist() == [1.0, 0.0]
    assert metrics["rollout/dropped_empty_mask"] == 1
    assert metrics["rollout/dropped_too_long"] == 1
    assert metrics["rollout/dropped_nonfinite_reward"] == 1
    assert metrics["rollout/dropped_small_group"] == 1


def test_circuit_breaker_trips_on_consecutive_failures():
    breaker = CircuitBreaker(max_consecutive=5)
    for _ in range(4):
        breaker.record(True, ValueError("boom"))
    breaker.record(False)  # a success resets the run
    for _ in range(4):
        breaker.record(True)
    with pytest.raises(RolloutCircuitOpen, match="5 times in a row"):
        breaker.record(True, ValueError("boom"))


def test_circuit_breaker_trips_on_failure_rate():
    breaker = CircuitBreaker(max_consecutive=100, window=20, max_failure_rate=0.5)
    for i in range(19):
        breaker.record(i % 2 == 0)  # 10 of 19 failed, window not full yet
    with pytest.raises(RolloutCircuitOpen, match="of the last 20 calls"):
        breaker.record(False)  # 10 of 20 = 50 %


def test_training_stops_when_rollouts_keep_failing():
    async def rollout_fn(row):
        raise ConnectionError("environment is down")

    with pytest.raises(RolloutCircuitOpen, match="environment is down"):
        next(_stream([{"id": i} for i in range(10)], rollout_fn, G=4))


def test_rollout_factory_is_imported_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rollout.py").write_text("def make_rollout_fn(setup):\n    return 'built'\n")
    monkeypatch.chdir(tmp_path)
    assert load_rollout_factory("my_rollout:make_rollout_fn")(None) == "built"
    with pytest.raises(ValueError, match="rollout.factory"):
        load_rollout_factory("my_rollout:missing")
