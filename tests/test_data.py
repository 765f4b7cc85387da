"""The rollout stream: row order, padding, the group filter and its replacement rows."""

import re

import pytest
import torch

from lit_grpo.callbacks.reward_filter import UniformRewardFilter, has_reward_variance
from lit_grpo.rollouts import GroupSampler, RowCursor, SynchronousScheduler, collate_groups, rollout_metrics
from lit_grpo.rollouts.datamodule import RolloutStream
from lit_grpo.types import PromptGroup, RolloutSample


def _sample(tokens, mask, reward, logprobs=None):
    return RolloutSample(tokens=tokens, logprobs=logprobs or [0.0] * len(tokens), loss_mask=mask, reward=reward)


def test_collate_pads_right_and_keeps_lists_parallel():
    g = PromptGroup(
        row={},
        version=3,
        samples=[_sample([1, 2, 3], [0, 1, 1], 1.0, [0.0, -0.5, -0.25]), _sample([1, 2], [0, 1], 0.0)],
    )
    batch = collate_groups([g], [[0.7, -0.7]], pad_id=0)
    assert batch.tokens_BT.tolist() == [[1, 2, 3], [1, 2, 0]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.loss_mask_BT.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.sampler_logprobs_BT[0].tolist() == [0.0, -0.5, -0.25]
    assert batch.advantages_B.tolist() == pytest.approx([0.7, -0.7])
    assert batch.versions_B.tolist() == [3, 3]


def test_row_cursor_is_seeded_and_covers_every_row_each_epoch():
    rows = [{"i": i} for i in range(7)]
    a, b = RowCursor(rows, epochs=2, seed=5, shuffle=True), RowCursor(rows, epochs=2, seed=5, shuffle=True)
    taken = [r["i"] for r in a.take(20)]
    assert taken == [r["i"] for r in b.take(20)]
    assert len(taken) == 14 and sorted(taken[:7]) == list(range(7)) and sorted(taken[7:]) == list(range(7))
    assert taken[:7] != taken[7:]  # reshuffled per epoch
    assert a.take(1) == []


def _stream(rows, rollout_fn, filters, P=2, G=3):
    groups = GroupSampler(rollout_fn, G, max_seq_len=64, min_group_size=2, filters=filters)
    scheduler = SynchronousScheduler(RowCursor(rows, 1, 0, shuffle=False), groups, P, max_concurrency=256)
    return iter(RolloutStream(scheduler, groups, max_steps=-1, pad_id=0))


def _next_batch(rewards_by_row, filters, P=2, G=3):
    """Rows carry their G rewards; the rollout returns them in turn."""
    rows = [{"id": i, "rewards": r} for i, r in enumerate(rewards_by_row)]
    counters = {}

    async def rollout_fn(row):
        k = counters.get(row["id"], 0)
        counters[row["id"]] = k + 1
        return _sample([1, 2], [0, 1], row["rewards"][k])

    batch = next(_stream(rows, rollout_fn, filters, P, G))
    return batch, rollout_metrics([batch.record])


def test_filter_drops_exactly_the_uniform_groups_and_refills():
    rewards = [[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5], [1, 0, 0], [1, 0, 1]]
    batch, metrics = _next_batch(rewards, [has_reward_variance])
    # rows 0, 2 and 3 are uniform; rows 1 and 4 fill the step; row 5 (sampled in the last refill) is surplus.
    assert batch.rewards_B.tolist() == [0, 1, 0, 1, 0, 0]
    assert metrics["rollout/filtered_groups"] == 3
    # Refill rounds over-sample by the running acceptance rate: rows 0-5 were all sampled.
    assert metrics["reward/mean"] == pytest.approx(sum(sum(r) for r in rewards) / 18)


def test_the_filter_documents_the_metric_its_drops_are_counted_in():
    _, metrics = _next_batch([[1, 1, 1], [0, 1, 0], [1, 0, 0]], [has_reward_variance])
    named = set(re.findall(r"`([a-z_]+/[a-z_]+)`", UniformRewardFilter.__doc__))
    assert named == {"rollout/filtered_groups"} and metrics["rollout/filtered_groups"] == 1


def test_without_filter_uniform_groups_train_with_zero_advantage():
    batch, metrics = _next_batch([[1, 1, 1], [0, 1, 0]], [])
    assert batch.advantages_B[:3].tolist() == [0, 0, 0]
    assert metrics["rollout/filtered_groups"] == 0


def test_failed_rollouts_are_counted_and_dropped():
    rows = [{"id": 0}, {"id": 1}]
    calls = {"n": 0}

    async def rollout_fn(row):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("tool crashed")
        return _sample([1, 2], [0, 1], float(calls["n"] % 2))

    batch = next(_stream(rows, rollout_fn, []))
    assert rollout_metrics([batch.record])["rollout/failures"] == 1
    assert batch.num_sequences == 5


def test_custom_predicate_by_dotted_path():
    keep = UniformRewardFilter(predicate="lit_grpo.callbacks.reward_filter.has_reward_variance")
    assert keep.predicate is has_reward_variance


def test_rank_shares_are_disjoint_and_interleave_into_the_single_process_order():
    rows = [{"i": i} for i in range(11)]
    single = [r["i"] for r in RowCursor(rows, epochs=2, seed=3, shuffle=True).take(100)]
    shares = [RowCursor(rows, epochs=2, seed=3, shuffle=True, rank=r, world_size=2) for r in (0, 1)]
    taken = [[r["i"] for r in s.take(100)] for s in shares]
    # 11 rows over 2 ranks: 5 each per epoch (the odd row is left out so the ranks stay in step).
    assert [len(t) for t in taken] == [10, 10]
    for epoch in (0, 1):
        a, b = taken[0][5 * epoch : 5 * epoch + 5], taken[1][5 * epoch : 5 * epoch + 5]
        assert not set(a) & set(b)
        # Position k of rank r is position 2k + r of the single-process order.
        assert [x for pair in zip(a, b) for x in pair] == single[11 * epoch : 11 * epoch + 10]


def test_a_rank_cursor_resumes_where_it_stopped_and_refuses_another_rank():
    rows = [{"i": i} for i in range(20)]
    cursor = RowCursor(rows, epochs=1, seed=0, shuffle=True, rank=1, world_size=2)
    first = cursor.take(3)
    state = cursor.state_dict(unfinished=[(0, 1)])  # row 1 of this share was still in flight
    resumed = RowCursor(rows, epochs=1, seed=0, shuffle=True, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert resumed.take(2) == [first[1], cursor.take(1)[0]]
    with pytest.raises(ValueError, match="rank"):
        RowCursor(rows, epochs=1, seed=0, shuffle=True, rank=0, world_size=2).load_state_dict(state)


def test_rollout_metrics_pool_ranks_by_hand():
    from lit_grpo.types import RolloutRecord

    a = RolloutRecord(
        rewards=[0.0, 1.0],
        completion_tokens=[2, 4],
        counts={"rollout/failures": 1},
        version_offsets=[0],
        timings={"perf/sample_s": 1.0},
    )
    b = RolloutRecord(
        rewards=[1.0, 1.0, 1.0, 1.0],
        completion_tokens=[1, 1, 1, 1],
        counts={"rollout/failures": 2, "rollout/filtered_groups": 1},
        version_offsets=[1, 0],
        timings={"perf/sample_s": 2.0},
    )
    m = rollout_metrics([a, b])
    assert m["reward/mean"] == pytest.approx(5 / 6)  # pooled samples, not the mean of rank means (0.75)
    assert m["reward/std"] == pytest.approx((5 / 6 * 1 / 6 * 6 / 5) ** 0.5)  # unbiased: Σ(r - m)² / (n - 1)
    assert m["rollout/failures"] == 3 and m["rollout/filtered_groups"] == 1 and m["rollout/groups_accepted"] == 3
    assert m["async/version_offset_mean"] == pytest.approx(1 / 3) and m["async/version_offset_max"] == 1
    assert m["perf/sample_s"] == 2.0  # the slowest rank
    assert m["rollout/completion_len_mean"] == pytest.approx(10 / 6)
    assert m["perf/sample_tokens_per_s"] == pytest.approx(10 / 2.0)


def test_reward_statistics_of_huge_rewards_stay_finite():
    from lit_grpo.types import RolloutRecord

    # Rewards 0 and 2e200: mean 1e200, unbiased std sqrt(2·(1e200)² / 1) = 1.414e200; float32 would give inf.
    m = rollout_metrics([RolloutRecord(rewards=[0.0, 2e200], completion_tokens=[1, 1])])
    assert m["reward/mean"] == pytest.approx(1e200) and m["reward/std"] == pytest.approx(2**0.5 * 1e200)
    g = PromptGroup(row={}, version=0, samples=[_sample([1, 2], [0, 1], 2e200), _sample([1, 2], [0, 1], 0.0)])
    batch = collate_groups([g], [[1.0, -1.0]], pad_id=0)
    assert batch.rewards_B.dtype == torch.float64 and batch.rewards_B.tolist() == [2e200, 0.0]


def test_sampler_logprobs_where_nothing_is_trained_are_zeroed():
    g = PromptGroup(
        row={},
        version=0,
        samples=[_sample([1, 2, 3], [0, 1, 1], 1.0, [float("nan"), -0.5, -0.25]), _sample([1, 2], [0, 1], 0.0)],
    )
    batch = collate_groups([g], [[1.0, -1.0]], pad_id=0)
    assert batch.sampler_logprobs_BT.tolist() == [[0.0, -0.5, -0.25], [0.0, 0.0, 0.0]]


def test_rows_running_out_before_max_steps_is_flagged_and_logged_once(caplog):
    rows = [{"id": i, "rewards": [0, 1, 0]} for i in range(3)]

    async def rollout_fn(row):
        return _sample([1, 2], [0, 1], float(row["id"] % 2))

    groups = GroupSampler(rollout_fn, 3, max_seq_len=64, min_group_size=2, filters=[])
    scheduler = SynchronousScheduler(RowCursor(rows, 1, 0, shuffle=False), groups, 2, max_concurrency=256)
    stream = RolloutStream(scheduler, groups, max_steps=10, pad_id=0)
    with caplog.at_level("WARNING", logger="lit_grpo.rollouts.datamodule"):
        assert [b.num_sequences for b in stream] == [6, 3]  # 2 groups, then the last row alone
        assert list(stream) == []
    assert stream.rows_exhausted
    assert [r.message for r in caplog.records].count(
        "the rows ran out after 2 of max_steps=10 steps (data.epochs, data.max_rows or the task's rows bound them, "
        "or curriculum.retire_after retired them all): the run ends early"
    ) == 1
