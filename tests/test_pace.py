"""A rollout deadline that trips says whether sampling is slow or stuck: the pace of the rows that
came back (tokens/s), the rows in flight, and the time they need at that pace; and the default
deadline follows `sampler.max_completion_tokens`."""

import asyncio
import logging

import pytest

from lit_grpo.config.guards import GuardsConfig
from lit_grpo.rollouts import GroupSampler
from lit_grpo.rollouts.pace import SamplingPace, deadline_notice
from lit_grpo.types import RolloutSample


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_pace_counts_the_tokens_of_the_rows_that_came_back_within_its_window():
    clock = _Clock()
    pace = SamplingPace(window_s=100.0, clock=clock)
    clock.now += 10
    pace.record(300)
    assert pace.tokens_per_s() == (30.0, 10.0)  # shorter than the window: over the 10 s since the start
    clock.now += 90
    pace.record(200)
    assert pace.tokens_per_s() == (5.0, 100.0)  # (300 + 200) / 100
    clock.now += 50  # the first row is 140 s old: out of the window
    pace.record(0)
    assert pace.tokens_per_s() == (2.0, 100.0)


def test_a_deadline_tripped_by_slow_sampling_is_said_to_be_slow_with_the_pace_and_the_rows_in_flight():
    notice = deadline_notice(
        300, tokens_per_s=20.0, over_s=120, rows_in_flight=16, completions_per_prompt=4, max_completion_tokens=128
    )
    # 16 rows x 4 completions x 128 tokens = 8192 tokens, 410 s at 20 tokens/s: past the 300 s deadline
    assert "16 rows in flight" in notice and "20.0 tokens/s" in notice
    assert "= 8192 tokens, about 410 s" in notice and "sampling is slow, not stuck" in notice
    assert "raise guards.rollout_timeout_s (null: 300 s plus 0.5 s per sampler.max_completion_tokens)" in notice
    quick = deadline_notice(
        300, tokens_per_s=500.0, over_s=120, rows_in_flight=16, completions_per_prompt=4, max_completion_tokens=128
    )
    assert "about 16 s" in quick and "the sampler keeps up" in quick
    stuck = deadline_notice(
        300, tokens_per_s=0.0, over_s=120, rows_in_flight=3, completions_per_prompt=4, max_completion_tokens=128
    )
    assert "no row has come back in the last 120 s: the sampler is stuck" in stuck


def test_the_default_deadline_follows_the_completion_length_and_a_set_one_stays():
    assert GuardsConfig().rollout_deadline_s(16) == 308.0
    assert GuardsConfig().rollout_deadline_s(4096) == 300.0 + 2048.0
    assert GuardsConfig(rollout_timeout_s=7.0).rollout_deadline_s(4096) == 7.0


@pytest.mark.timeout(30)
def test_the_first_timeout_of_a_run_logs_the_pace_of_the_rows_before_it(caplog):
    """Two rows come back with 4 x 3 generated tokens each, then a row's calls outlast the deadline:
    the warning gives the pace of those 24 tokens and the one row in flight."""
    calls = {"n": 0}

    async def rollout_fn(row):
        calls["n"] += 1
        if row["id"] == 2:
            await asyncio.sleep(30)
        return RolloutSample(tokens=[1, 2, 3, 4], logprobs=[0.0, -0.1, -0.1, -0.1], loss_mask=[0, 1, 1, 1], reward=1.0)

    groups = GroupSampler(
        rollout_fn,
        4,
        max_seq_len=64,
        min_group_size=2,
        filters=[],
        rollout_timeout_s=0.3,
        max_retries=0,
        max_completion_tokens=3,
    )
    clock = _Clock()
    groups.pace = SamplingPace(window_s=100.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="lit_grpo.rollouts.groups"):
        for row_id in (0, 1):
            asyncio.run(groups.sample({"id": row_id}, version=0))
        clock.now += 6.0
        asyncio.run(groups.sample({"id": 2}, version=0))
    (line,) = [r.getMessage() for r in caplog.records if "rows in flight" in r.getMessage()]
    assert "guards.rollout_timeout_s=0.3 s with 1 rows in flight" in line
    assert "came at 4.0 tokens/s (over the last 6 s)" in line  # the two rows' 24 generated tokens in 6 s
    assert "1 x 4 x 3 = 12 tokens, about 3 s" in line and line.endswith("(counted in rollout/timeouts)")
    assert groups.take_counts()["rollout/timeouts"] == 4
