"""Scoring with the run's reward (`lit_grpo.rewards.scoring`): async and plain components, the
concurrency limit, the deadline and its fallback (said once, counted, said again at the end of a
run, and a run whose rewards are mostly fallbacks stopped), weighted components, a bug in a reward,
and a training run whose reward is an `async def`."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import pytest
from conftest import compose_config, trained_steps

from lit_grpo.errors import EnvironmentFault
from lit_grpo.rewards import RewardScorer, WeightedReward, get_reward, inline_reward, is_async_reward
from lit_grpo.rewards.scoring import TIMED_OUT_METRIC, TIMEOUT_WINDOW, RewardTimeouts
from lit_grpo.train import train


class InFlight:
    """Counts the calls running at once (from any thread) and the most seen."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def test_async_and_plain_rewards_are_told_apart():
    async def judge(text, row):
        return 1.0

    class Judge:
        async def __call__(self, text, row):
            return 1.0

    assert is_async_reward(judge) and is_async_reward(Judge())
    assert not is_async_reward(lambda text, row: 1.0) and not is_async_reward(len)


@pytest.mark.timeout(30)
def test_64_async_rewards_with_a_limit_of_8_never_run_more_than_8():
    seen = InFlight()

    async def slow_judge(text, row):
        seen.enter()
        await asyncio.sleep(0.02)
        seen.leave()
        return float(len(text))

    scorer = RewardScorer(slow_judge, max_concurrency=8, timeout_s=10.0)
    results = scorer.score_all_blocking([("x" * i, {}) for i in range(64)])
    assert [r.value for r in results] == [float(i) for i in range(64)]
    assert seen.most == 8  # the limit is reached, never passed


@pytest.mark.timeout(30)
def test_plain_rewards_run_on_threads_under_the_same_limit():
    seen = InFlight()

    def slow_regex(text, row):
        seen.enter()
        time.sleep(0.02)
        seen.leave()
        return 1.0

    scorer = RewardScorer(slow_regex, max_concurrency=3, timeout_s=10.0)
    start = time.perf_counter()
    results = scorer.score_all_blocking([("a", {})] * 12)
    assert all(r.value == 1.0 and not r.timed_out for r in results)
    assert 1 < seen.most <= 3  # concurrent (threads), bounded
    assert time.perf_counter() - start < 12 * 0.02  # faster than one after another


@pytest.mark.timeout(30)
def test_a_reward_past_its_deadline_gives_the_fallback_never_a_stall():
    async def hung_judge(text, row):
        await asyncio.sleep(3600)

    def hung_plain(text, row):
        time.sleep(2)  # a plain function cannot be stopped: its thread finishes later, the score does not wait
        return 1.0

    for fn in (hung_judge, hung_plain):
        scorer = RewardScorer(fn, timeout_s=0.2, timeout_reward=-1.0)
        start = time.perf_counter()
        [result] = scorer.score_all_blocking([("a", {})])
        assert time.perf_counter() - start < 1.5
        assert result.value == -1.0 and result.timed_out
        assert result.metrics[TIMED_OUT_METRIC] == 1.0


@pytest.mark.timeout(30)
def test_weighted_components_each_under_their_deadline():
    # 2·fast + 0.5·slow: slow times out with fallback 0 -> 2·1 + 0.5·0 = 2; parts per component.
    async def fast(text, row):
        return 1.0

    async def slow(text, row):
        await asyncio.sleep(3600)

    scorer = RewardScorer(WeightedReward([("fast", fast), ("slow", slow)], [2.0, 0.5]), timeout_s=0.2)
    [result] = scorer.score_all_blocking([("a", {})])
    assert result.value == 2.0 and result.timed_out
    assert result.parts == {"reward/fast": 1.0, "reward/slow": 0.0}


async def slow_on_request(text: str, row: dict) -> float:
    """1.0 at once, or never for a text starting with "slow"."""
    if text.startswith("slow"):
        await asyncio.sleep(3600)
    return 1.0


@pytest.mark.timeout(30)
def test_a_substitution_is_said_once_and_counted(caplog):
    # Two fallbacks and three real rewards, over two calls: one warning, naming the field, the value
    # put in place and the reward function; the counts the end-of-run line reads.
    scorer = RewardScorer(slow_on_request, timeout_s=0.1, timeout_reward=-1.0)
    with caplog.at_level(logging.WARNING, logger="lit_grpo.rewards.scoring"):
        scorer.score_all_blocking([("slow 1", {}), ("fast", {}), ("fast", {})])
        scorer.score_all_blocking([("slow 2", {}), ("fast", {})])
    assert (scorer.samples, scorer.timed_out) == (5, 2)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "reward.timeout_s=0.1: the reward test_reward_scoring.slow_on_request did not answer in time, so the sample "
        "scores reward.timeout_reward=-1 in its place and trains on it as if it were its reward (counted in "
        "reward/timed_out; said once, the total at the end of the run)"
    ]
    assert scorer.timeout_summary(2, 5) == (
        "reward.timeout_s=0.1: 2 of 5 samples scored reward.timeout_reward=-1 in place of their reward "
        "(reward/timed_out)"
    )


@pytest.mark.timeout(30)
def test_scoring_stops_once_fallbacks_are_more_than_the_share_of_the_recent_samples():
    # Half of the last 64 is allowed (max_timeout_share=0.5), one more fallback is not.
    half = TIMEOUT_WINDOW // 2
    scorer = RewardScorer(slow_on_request, timeout_s=0.05)
    scorer.score_all_blocking([("fast", {})] * half + [("slow", {})] * half)
    with pytest.raises(RewardTimeouts) as stopped:
        scorer.score_all_blocking([("slow", {})])
    assert str(stopped.value) == (
        f"reward.timeout_s=0.05: {half + 1} of the last {TIMEOUT_WINDOW} samples scored reward.timeout_reward=0 in "
        "place of their reward, more than reward.max_timeout_share=0.5 of them: the reward "
        "test_reward_scoring.slow_on_request is down or too slow, and the policy would learn from stand-ins"
    )
    never = RewardScorer(slow_on_request, timeout_s=0.05, max_timeout_share=1.0)  # 1.0: never stop
    assert all(r.timed_out for r in never.score_all_blocking([("slow", {})] * (TIMEOUT_WINDOW + 1)))


@pytest.mark.timeout(30)
def test_none_is_not_applicable_and_a_bad_value_is_a_bug():
    async def not_applicable(text, row):
        return None

    [result] = RewardScorer(not_applicable).score_all_blocking([("a", {})])
    assert result.value is None and not result.timed_out
    # A lone reward's value goes on as it came (the rollout checks drop a non-number, counted); a
    # weighted component's must be a number.
    assert RewardScorer(lambda text, row: "high").score_all_blocking([("a", {})])[0].value == "high"
    with pytest.raises(TypeError, match="reward 'bad' returned str 'high', not a number or None"):
        RewardScorer(WeightedReward([("bad", lambda text, row: "high")], [1.0])).score_all_blocking([("a", {})])
    with pytest.raises(ZeroDivisionError):  # a bug in the reward is not swallowed
        RewardScorer(lambda text, row: 1 / 0).score_all_blocking([("a", {})])


@pytest.mark.timeout(30)
def test_inline_rewards_run_on_the_loop_others_on_a_thread_of_their_own():
    threads = {}

    def plain(text, row):
        threads["plain"] = threading.current_thread()
        return 1.0

    @inline_reward
    def cheap(text, row):
        threads["cheap"] = threading.current_thread()
        return 1.0

    for fn in (plain, cheap):
        RewardScorer(fn).score_all_blocking([("a", {})])
    assert threads["cheap"] is threading.main_thread()  # `asyncio.run`'s loop runs on the calling thread
    assert threads["plain"] is not threading.main_thread() and threads["plain"].daemon
    assert all(getattr(get_reward(name), "lit_grpo_inline", False) for name in ("arithmetic", "gsm8k", "exact_match"))


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_concurrency"):
        RewardScorer(len, max_concurrency=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardScorer(len, timeout_s=0.0)


# --------------------------------------------------------------------------- in a run


async def async_arithmetic(completion_text: str, row: dict) -> float:
    """The demo's reward behind an await, as a judge would be (importable as test_reward_scoring:...)."""
    from lit_grpo.rewards.arithmetic import arithmetic

    await asyncio.sleep(0)
    return arithmetic(completion_text, row)


async def never_answers(completion_text: str, row: dict) -> float:
    await asyncio.sleep(3600)


def _steps(tmp_path, *overrides):
    train(
        compose_config(
            "+experiment=arithmetic", "max_steps=3", "trainer.enable_progress_bar=false", "~callbacks.reward_filter",
            *overrides, output_dir=tmp_path,
        )
    )  # fmt: skip
    return trained_steps(tmp_path, "reward/mean")


@pytest.mark.timeout(300)
def test_an_async_reward_trains_like_the_plain_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    plain = _steps(tmp_path / "plain")
    awaited = _steps(tmp_path / "async", "reward.fn=test_reward_scoring:async_arithmetic")
    assert [s["reward/mean"] for s in awaited] == [s["reward/mean"] for s in plain]
    assert all(s[TIMED_OUT_METRIC] == 0.0 for s in awaited)


NEVER_ANSWERS = ["reward.fn=test_reward_scoring:never_answers", "reward.timeout_s=0.3", "reward.timeout_reward=0.25"]


@pytest.mark.timeout(300)
def test_a_reward_that_never_answers_costs_its_deadline_not_the_run(tmp_path, monkeypatch, caplog):
    # With reward.max_timeout_share=1.0, a run trains on the fallbacks: said at the first and at the end.
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="lit_grpo"):
        steps = _steps(tmp_path, *NEVER_ANSWERS, "reward.max_timeout_share=1.0")
    assert len(steps) == 3 and time.perf_counter() - start < 120
    assert all(s[TIMED_OUT_METRIC] == 1.0 and s["reward/mean"] == 0.25 for s in steps)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reward.timeout_s=0.3")]
    assert len(said) == 2, said
    assert said[0].startswith("reward.timeout_s=0.3: the reward test_reward_scoring.never_answers did not answer")
    counted = re.fullmatch(
        r"reward\.timeout_s=0\.3: (\d+) of (\d+) samples scored reward\.timeout_reward=0\.25 .*", said[1]
    )
    assert counted and counted[1] == counted[2] and int(counted[1]) >= 3 * 64, said[
        1
    ]  # every sample, 3 steps' at least


@pytest.mark.timeout(300)
def test_a_run_whose_rewards_are_mostly_fallbacks_stops(tmp_path, monkeypatch):
    # By default (reward.max_timeout_share=0.5) the 64th fallback in a row stops the run, saying what to do.
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    with pytest.raises(EnvironmentFault) as stopped:  # the run's stop on a fault: its last finished step kept
        _steps(tmp_path, *NEVER_ANSWERS)
    message = str(stopped.value)
    assert message.startswith(
        "reward.timeout_s=0.3: 64 of the last 64 samples scored reward.timeout_reward=0.25 in place of their reward"
    )
    assert "training stopped after step 0. No step had finished. Bring the reward back" in message, message
    assert "reward.max_timeout_share=1.0 to train on the substitutes anyway, and run again" in message
