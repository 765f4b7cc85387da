"""The rollout contract's two generations: a `RolloutSample`, or a `RolloutRun` of segments that
share one reward and one advantage; and the context keywords a rollout function may declare."""

import asyncio
import math
from collections import Counter

import pytest

from lit_grpo.rollouts import GroupSampler, RowCursor, SynchronousScheduler
from lit_grpo.rollouts.context import CONTEXT_KEYWORDS, declared_context
from lit_grpo.rollouts.pipeline import checked_samples, make_batch
from lit_grpo.types import PromptGroup, RolloutRun, RolloutSample


def _sample(reward, n_prompt=1, n_gen=2, start=1):
    tokens = list(range(start, start + n_prompt + n_gen))
    return RolloutSample(tokens, [0.0] * n_prompt + [-0.5] * n_gen, [0] * n_prompt + [1] * n_gen, reward)


def test_a_run_is_kept_whole_or_dropped_whole_with_its_reason():
    two = RolloutRun(segments=[_sample(1.0), _sample(1.0, start=5)])
    differ = RolloutRun(segments=[_sample(1.0), _sample(0.0)])
    bad_segment = RolloutRun(segments=[_sample(1.0), RolloutSample([1, 2], [0.0], [0, 1], 1.0)])
    empty = RolloutRun(segments=[])
    samples, sizes, counts, details = checked_samples(
        [two, _sample(0.0), None, differ, bad_segment, empty], max_seq_len=64
    )
    assert sizes == [2, 1]
    assert samples == [*two.segments, samples[2]] and samples[2].reward == 0.0
    assert counts == Counter(
        {
            "rollout/dropped_none": 1,
            "rollout/dropped_segment_rewards_differ": 1,
            "rollout/dropped_length_mismatch": 1,
            "rollout/dropped_empty_run": 1,
        }
    )
    assert details["rollout/dropped_length_mismatch"].startswith("segment 1:")


def test_segments_share_their_runs_advantage_and_statistics_count_runs():
    # Three runs: rewards 1, 0, 0; the first has two segments. Worked by hand: mean 1/3, unbiased
    # std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3); advantages (r - mean) / std.
    group = PromptGroup(
        row={},
        version=0,
        samples=[_sample(1.0), _sample(1.0, start=7), _sample(0.0), _sample(0.0)],
        run_sizes=[2, 1, 1],
    )
    assert group.rewards == [1.0, 0.0, 0.0]
    batch = make_batch([group], [group], version=0, pad_id=0, counts=Counter(), timings={})
    std = math.sqrt(1 / 3)
    expected = [(2 / 3) / std, (2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std]
    assert batch.advantages_B.tolist() == pytest.approx(expected, rel=1e-5)
    assert batch.num_sequences == 4
    assert batch.record.rewards == [1.0, 0.0, 0.0]  # per run, for reward/mean
    assert batch.record.completion_tokens == [4, 2, 2]  # a run's trained tokens over its segments


def test_context_keywords_reach_the_functions_that_declare_them():
    seen = []

    async def plain(row):
        seen.append(("plain", row["i"]))
        return _sample(float(row["i"] % 2))

    async def some(row, *, row_index, rollout_idx, evaluation):
        seen.append(("some", row_index, rollout_idx, evaluation))
        return _sample(float(rollout_idx))

    async def everything(row, **context):
        seen.append(("all", dict(context)))
        return _sample(float(context["sample_index"]))

    assert declared_context(plain) == frozenset() and declared_context(everything) == CONTEXT_KEYWORDS
    rows = [{"i": i} for i in range(3)]
    for fn in (plain, some, everything):
        seen.clear()
        groups = GroupSampler(fn, 2, max_seq_len=64, min_group_size=2, filters=[])
        scheduler = SynchronousScheduler(RowCursor(rows, 2, 0, shuffle=False), groups, 1, max_concurrency=8)
        try:
            for _ in range(4):
                scheduler.next_groups()
        finally:
            scheduler.close()
        if fn is some:
            assert {(i, k) for _, i, k, _ in seen} == {(i, k) for i in range(3) for k in range(2)}
            assert not any(e for *_, e in seen)
        if fn is everything:
            contexts = [c for _, c in seen]
            assert all(set(c) == CONTEXT_KEYWORDS for c in contexts)
            # Epoch 0 then epoch 1 of 3 unshuffled rows; the last row of an epoch says so.
            firsts = [c for c in contexts if c["sample_index"] == 0]
            assert [(c["epoch"], c["row_index"], c["cursor_index"], c["end_of_epoch"]) for c in firsts] == [
                (0, 0, 0, False),
                (0, 1, 1, False),
                (0, 2, 2, True),
                (1, 0, 3, False),
            ]


def test_cursor_context_of_a_rank_names_the_global_position():
    rows = [{"i": i} for i in range(6)]
    cursor = RowCursor(rows, 1, 0, shuffle=False, rank=1, world_size=2)
    positions = [p for p, _ in cursor.take_positioned(3)]
    contexts = [cursor.context(p) for p in positions]
    assert [c["row_index"] for c in contexts] == [1, 3, 5]
    assert [c["cursor_index"] for c in contexts] == [1, 3, 5]
    assert [c["end_of_epoch"] for c in contexts] == [False, False, True]


def test_a_run_of_two_segments_trains_end_to_end():
    async def two_segments(row):
        return RolloutRun(segments=[_sample(float(row["i"] % 2)), _sample(float(row["i"] % 2), start=9)])

    async def one(row):
        return _sample(0.0)

    calls = iter([two_segments, one, two_segments, one])

    async def mixed(row):
        return await next(calls)(row)

    groups = GroupSampler(mixed, 2, max_seq_len=64, min_group_size=2, filters=[])
    group = asyncio.run(groups.sample({"i": 1}, 0))
    assert group.run_sizes == [2, 1] and group.rewards == [1.0, 0.0] and len(group.samples) == 3
