"""Malformed samples are dropped and counted by reason; failing rollouts are retried, counted or
raised by kind and trip the circuit breaker; rows that give nothing to train on stop the run."""

import asyncio
import math

import numpy as np
import pytest

from lit_grpo.rollouts import GroupSampler, RowCursor, SynchronousScheduler, rollout_metrics
from lit_grpo.rollouts.checks import CircuitBreaker, NoProgressError, ProgressGuard, RolloutCircuitOpen, sample_problem
from lit_grpo.rollouts.datamodule import RolloutStream
from lit_grpo.rollouts.deadlines import RolloutTimeout, call_rollout
from lit_grpo.rollouts.rollout import load_rollout_factory
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
        (dict(tokens=None), "not_a_list"),
        (dict(loss_mask=[0, 2, 1]), "bad_mask"),
        (dict(loss_mask=[0, 1, "1"]), "bad_mask"),
        (dict(tokens=[1, 2, 100]), "bad_token"),  # vocabulary of 50
        (dict(tokens=[1, -2, 3]), "bad_token"),
        (dict(tokens=[1, 2.0, 3]), "bad_token"),
        (dict(tokens=[1, True, 3]), "bad_token"),
        (dict(logprobs=[0.0, 0.5, -0.2]), "bad_logprob"),
        (dict(logprobs=[0.0, math.nan, -0.2]), "bad_logprob"),
        (dict(logprobs=[0.0, -math.inf, -0.2]), "bad_logprob"),
        (dict(logprobs=[0.0, "-0.1", -0.2]), "bad_logprob"),
        (dict(reward="1.0"), "nonnumeric_reward"),
        (dict(reward=None), "nonnumeric_reward"),
        (dict(reward=True), "nonnumeric_reward"),
    ],
)
def test_each_bad_sample_kind_is_named(change, reason):
    assert sample_problem(RolloutSample(**GOOD), max_seq_len=8, vocab_size=50) is None
    assert sample_problem(RolloutSample(**{**GOOD, **change}), max_seq_len=8, vocab_size=50) == reason
    assert sample_problem({"tokens": [1]}, max_seq_len=8) == "not_a_sample"


def test_what_passes_the_checks():
    # numpy ints and floats are numbers; a logprob a hair above 0 is rounding; a NaN where nothing is
    # trained is left to the batch (which zeroes it); without a vocabulary size any id >= 0 passes.
    fine = [
        dict(tokens=[int(t) for t in np.array([1, 2, 3])], reward=np.float64(0.5)),
        dict(tokens=list(np.array([1, 2, 3], dtype=np.int64))),
        dict(logprobs=[0.0, 1e-6, -0.2]),
        dict(logprobs=[math.nan, -0.1, -0.2]),
        dict(loss_mask=[0.0, 1.0, True]),
    ]
    for change in fine:
        assert sample_problem(RolloutSample(**{**GOOD, **change}), max_seq_len=8, vocab_size=50) is None, change
    assert sample_problem(RolloutSample(**{**GOOD, "tokens": [1, 2, 10**6]}), max_seq_len=8) is None


def _stream(rows, rollout_fn, *, G, max_seq_len=64, P=2, max_steps=-1, **group_kwargs):
    groups = GroupSampler(rollout_fn, G, max_seq_len=max_seq_len, min_group_size=2, filters=[], **group_kwargs)
    scheduler = SynchronousScheduler(RowCursor(rows, 1, 0, False), groups, P, max_concurrency=256)
    return RolloutStream(scheduler, groups, max_steps=max_steps, pad_id=0)


def test_pipeline_drops_and_counts_bad_samples_and_small_groups():
    # Row 0: one good sample, two bad ones -> group of 1 < min_group_size, dropped.
    # Row 1: rewards 1, 0 plus a NaN reward -> a group of 2 that trains.
    bad = {
        0: [
            GOOD,
            {**GOOD, "loss_mask": [0, 0, 0]},
            {**GOOD, "tokens": [1] * 20, "logprobs": [0.0] * 20, "loss_mask": [1] * 20},
        ],
        1: [GOOD, {**GOOD, "reward": 0.0}, {**GOOD, "reward": math.nan}],
    }
    calls = {0: 0, 1: 0}

    async def rollout_fn(row):
        k = calls[row["id"]]
        calls[row["id"]] += 1
        return RolloutSample(**bad[row["id"]][k])

    batch = next(iter(_stream([{"id": 0}, {"id": 1}], rollout_fn, G=3, max_seq_len=8)))
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
    with pytest.raises(RolloutCircuitOpen, match="5 rows in a row"):
        breaker.record(True, ValueError("boom"))


def test_circuit_breaker_trips_on_failure_rate():
    breaker = CircuitBreaker(max_consecutive=100, window=20, max_failure_rate=0.5)
    for i in range(19):
        breaker.record(i % 2 == 0)  # 10 of 19 failed, window not full yet
    with pytest.raises(RolloutCircuitOpen, match="of the last 20 rows"):
        breaker.record(False)  # 10 of 20 = 50 %


def test_a_row_fails_once_however_many_of_its_calls_raised_and_only_when_all_did():
    """1 row in 5 raises on every call, another on one call in G: 60 rows train, the breaker never
    opens (a group's failure counts once, not G times), and the drops are counted."""
    calls: dict[int, int] = {}

    async def rollout_fn(row):
        calls[row["id"]] = calls.get(row["id"], 0) + 1
        if row["id"] % 5 == 0 or (row["id"] % 5 == 1 and calls[row["id"]] == 1):
            raise RuntimeError(f"the reward failed on row {row['id']}")
        return RolloutSample(
            tokens=[1, 2, 3], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1], reward=float(calls[row["id"]] % 2)
        )

    failures = 0
    for batch in _stream([{"id": i} for i in range(60)], rollout_fn, G=4, max_retries=0):
        failures += batch.record.counts.get("rollout/failures", 0)
    assert failures == 12 * 4 + 12  # every call of 12 rows, one call of 12 others


def test_training_stops_when_rollouts_keep_failing():
    async def rollout_fn(row):
        raise ConnectionError("environment is down")

    with pytest.raises(RolloutCircuitOpen, match="environment is down"):
        next(iter(_stream([{"id": i} for i in range(10)], rollout_fn, G=4, max_retries=0)))


def test_rollout_factory_is_imported_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rollout.py").write_text("def make_rollout_fn(setup):\n    return 'built'\n")
    monkeypatch.chdir(tmp_path)
    assert load_rollout_factory("my_rollout:make_rollout_fn")(None) == "built"
    with pytest.raises(ValueError, match="rollout.factory"):
        load_rollout_factory("my_rollout:missing")


# --------------------------------------------------------------------------- deadlines and error kinds


def _call(rollout_fn, *, timeout_s=5.0, max_retries=2):
    events = []
    result = asyncio.run(
        call_rollout(
            rollout_fn,
            {"id": 0},
            timeout_s=timeout_s,
            max_retries=max_retries,
            count=lambda key, err: events.append(key),
        )
    )
    return result, events


def test_a_transient_error_is_retried_then_returned(monkeypatch):
    monkeypatch.setattr("lit_grpo.rollouts.deadlines.RETRY_BACKOFF_S", 0.01)
    calls = []

    async def flaky(row):
        calls.append(1)
        if len(calls) <= 2:
            raise ConnectionError("down")
        return "ok"

    assert _call(flaky) == ("ok", ["rollout/retries", "rollout/retries"])
    calls.clear()
    result, events = _call(flaky, max_retries=1)  # the second failure is the last try
    assert isinstance(result, ConnectionError) and events == ["rollout/retries"]


def test_other_errors_are_returned_at_once_and_bugs_are_raised():
    async def broken_tool(row):
        raise RuntimeError("tool crashed")

    result, events = _call(broken_tool)
    assert isinstance(result, RuntimeError) and events == []  # a failure, not retried

    async def buggy(row):
        return row["missing"]

    with pytest.raises(KeyError) as raised:
        _call(buggy)
    assert "a bug in the rollout stops training at once" in raised.value.__notes__[0]
    assert "buggy" in raised.value.__notes__[0]

    def not_async(row):
        return RolloutSample(**GOOD)

    with pytest.raises(TypeError, match="must be `async def"):
        _call(not_async)


def test_a_rollout_past_its_deadline_is_cancelled_and_counted(monkeypatch):
    monkeypatch.setattr("lit_grpo.rollouts.deadlines.RETRY_BACKOFF_S", 0.01)
    cancelled = []

    async def sleeps(row):
        try:
            await asyncio.sleep(10**9)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise

    result, events = _call(sleeps, timeout_s=0.05, max_retries=1)
    assert isinstance(result, RolloutTimeout) and "guards.rollout_timeout_s=0.05" in str(result)
    assert events == ["rollout/timeouts", "rollout/retries", "rollout/timeouts"]
    assert len(cancelled) == 2


def test_a_none_is_counted_and_rows_that_give_nothing_stop_the_run():
    async def none(row):
        return None

    with pytest.raises(
        NoProgressError, match=r"(?s)last 3 rows.*3  none: the rollout returned None.*12  rollout/dropped_none"
    ):
        next(iter(_stream([{"id": i} for i in range(10)], none, G=4, max_rows_without_progress=3)))
    # Fewer rows than the guard's bound: the rows run out before any step, which is no success either.
    with pytest.raises(NoProgressError, match=r"all 2 rows of this rank's share \(they ran out first\)"):
        next(iter(_stream([{"id": i} for i in range(2)], none, G=4)))


def test_a_prompt_that_fills_max_seq_len_is_never_sampled():
    calls = []

    async def rollout_fn(row):
        calls.append(row["id"])
        return RolloutSample(**{**GOOD, "reward": float(len(calls) % 2)})

    rows = [
        {"id": 0, "prompt_token_ids": [5] * 8},
        {"id": 1, "prompt_token_ids": [5]},
        {"id": 2, "prompt_token_ids": [5]},
    ]
    batch = next(iter(_stream(rows, rollout_fn, G=2, max_seq_len=8)))
    assert 0 not in calls and batch.num_sequences == 4
    assert rollout_metrics([batch.record])["rollout/dropped_prompt_too_long"] == 2


def test_the_no_progress_message_names_the_dominant_reason_and_what_to_check():
    guard = ProgressGuard(4, max_seq_len=64)
    guard.examples["nonnumeric_reward"] = "reward '1' (str)"
    guard.rejected("rollout/filtered_groups", {})
    guard.accepted()  # progress: the count starts again
    for _ in range(2):
        guard.rejected("rollout/dropped_small_group", {"rollout/dropped_nonnumeric_reward": 3, "rollout/retries": 9})
    guard.rejected("rollout/filtered_groups", {})
    with pytest.raises(NoProgressError) as stopped:
        guard.rejected("rollout/dropped_small_group", {"rollout/failures": 4})
    message = str(stopped.value)
    assert "last 4 rows sampled (guards.max_rows_without_progress=4)" in message
    assert "2  nonnumeric_reward: a reward that is not a number" in message
    assert "1  filtered_groups" in message and "1  failures" in message
    assert "6  rollout/dropped_nonnumeric_reward" in message
    assert "Check: the reward must be a float" in message and "first seen: reward '1' (str)" in message


@pytest.mark.timeout(60)
def test_a_slow_step_says_what_it_waits_on(monkeypatch, caplog):
    """One line a period while a step's groups are awaited: rows sampled, drops, rows still sampling."""
    import logging

    import lit_grpo.rollouts.waiting as waiting

    monkeypatch.setattr(waiting, "WAIT_REPORT_S", 0.2)

    async def rollout_fn(row):
        if row["id"] == 0:
            raise RuntimeError("a bad row")
        await asyncio.sleep(1.0)
        return RolloutSample(**{**GOOD, "reward": float(row["id"] % 2)})

    with caplog.at_level(logging.INFO, logger="lit_grpo.rollouts.waiting"):
        next(iter(_stream([{"id": i} for i in range(4)], rollout_fn, G=2, P=3)))
    lines = [r.getMessage() for r in caplog.records if r.name == "lit_grpo.rollouts.waiting"]
    assert lines and lines[0].startswith("step 1: waiting 0 s for its groups: ")
    assert "rows sampled since it began" in lines[0]
    assert "failures 2" in lines[-1] and "rows sampling now: 1, the oldest for" in lines[-1]


def test_groups_that_keep_coming_back_uniform_are_said_to_be_once_with_the_reward_and_what_to_change():
    from lit_grpo.rollouts.checks import UniformGroupWatch

    now = [0.0]
    watch = UniformGroupWatch(completions_per_prompt=4, stop_after_rows=80, period_s=60.0, clock=lambda: now[0])
    notes = []
    for i in range(12):  # 11 uniform groups at 0, one that trains, over 66 s
        now[0] = 6.0 * i
        notes.append(watch.record([0.0, 1.0, 0.0, 0.0] if i == 3 else [0.0] * 4))
    said = [n for n in notes if n]
    assert len(said) == 1 and notes.index(said[0]) == 10  # the first group past the 60 s period
    assert said[0].startswith("10 of the 11 groups sampled in the last 60 s (91%) came back uniform")
    assert "all 4 completions with one reward (10 at 0)" in said[0]
    assert "rarely earns any reward" in said[0]
    for advice in ("reward.fn=", "data.completions_per_prompt=8", "~callbacks.reward_filter", "sampler.temperature"):
        assert advice in said[0]
    assert "stops after 80 rows in a row" in said[0]
    now[0] = 200.0
    assert watch.record([0.0] * 4) is None  # once a run


def test_a_run_whose_groups_mostly_train_is_not_warned():
    from lit_grpo.rollouts.checks import UniformGroupWatch

    now = [0.0]
    watch = UniformGroupWatch(completions_per_prompt=2, stop_after_rows=80, period_s=10.0, clock=lambda: now[0])
    for i in range(40):  # 70 % uniform, at 1.0 and 0.0: under the 80 % that is worth a warning
        now[0] = float(i)
        assert watch.record([1.0, 1.0] if i % 10 < 4 else [0.0, 0.0] if i % 10 < 7 else [0.0, 1.0]) is None


def test_a_stream_of_uniform_groups_warns_and_then_stops_after_its_budget(caplog):
    """Through the real group sampler: every group scores 0, so the watch speaks (its period made
    short), then the no-progress guard stops the run after the budget given in rows."""
    import logging

    async def rollout_fn(row):
        return RolloutSample(**{**GOOD, "reward": 0.0})

    with caplog.at_level(logging.WARNING, logger="lit_grpo.rollouts.groups"):
        with pytest.raises(NoProgressError, match=r"(?s)last 20 rows.*20  filtered_groups"):
            groups = GroupSampler(
                rollout_fn, 4, max_seq_len=64, min_group_size=2, filters=[lambda g: False], max_rows_without_progress=20
            )
            groups.uniform_watch.period_s = 0.0
            scheduler = SynchronousScheduler(
                RowCursor([{"id": i} for i in range(100)], 1, 0, False), groups, 2, max_concurrency=4
            )
            next(iter(RolloutStream(scheduler, groups, max_steps=-1, pad_id=0)))
    warnings = [r.getMessage() for r in caplog.records if "came back uniform" in r.getMessage()]
    assert len(warnings) == 1 and "(4 at 0)" in warnings[0] and "stops after 20 rows" in warnings[0]


def test_the_no_progress_budget_defaults_to_ten_steps_of_rows_and_at_least_a_hundred():
    from lit_grpo.config.guards import NO_PROGRESS_MIN_ROWS, NO_PROGRESS_STEPS, GuardsConfig

    assert (NO_PROGRESS_STEPS, NO_PROGRESS_MIN_ROWS) == (10, 100)
    assert GuardsConfig().rows_without_progress(16) == 160
    assert GuardsConfig().rows_without_progress(4) == 100
    assert GuardsConfig(max_rows_without_progress=7).rows_without_progress(4) == 7
