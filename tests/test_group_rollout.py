"""The group path: a rollout function's `sample_group(row, n)` samples a row's G trajectories in
one call, with one deadline and retry budget, and gives what G single calls would."""

import asyncio
import time

import pytest
import torch

from lit_grpo.rollouts import GroupSampler
from lit_grpo.rollouts.rollout import GROUP_ATTRIBUTE, group_rollout_fn, make_rollout_fn
from lit_grpo.samplers.hf import HFSampler
from lit_grpo.types import Completion, RolloutSample, RolloutSetup

G = 4


def _reward(text: str, row: dict) -> float:
    return float(text.startswith(row["answer"]))


def _setup(sampler, tokenizer) -> RolloutSetup:
    return RolloutSetup(
        sampler=sampler,
        tokenizer=tokenizer,
        sample_kwargs={"temperature": 1.0, "max_tokens": 3},
        extras={"reward_fn": _reward},
        completions_per_prompt=G,
    )


class _ServerLikeSampler:
    """A sampler whose n completions are n separate requests (they may fail one by one)."""

    group_requests = False

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        return [
            Completion(
                full_tokens=list(prompt) + [5],
                prompt_len=len(prompt),
                sampling_logprobs=[-0.1],
                finish_reason="length",
                text="x",
            )
            for _ in range(n)
        ]


def test_the_default_rollout_has_a_group_path_only_for_in_process_samplers(tokenizer, tiny_model):
    sampler = HFSampler(tiny_model, tokenizer)
    try:
        assert callable(group_rollout_fn(make_rollout_fn(_setup(sampler, tokenizer))))
    finally:
        sampler.close()
    assert group_rollout_fn(make_rollout_fn(_setup(_ServerLikeSampler(tokenizer), tokenizer))) is None


@pytest.mark.timeout(60)
def test_the_group_path_gives_the_samples_of_g_single_calls(tokenizer, tiny_model):
    # Same seed, same rows: one n=G request per row must batch the same prompts in the same order
    # as G requests of one, so the engine samples exactly the same tokens.
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2)]]
    sampler = HFSampler(tiny_model, tokenizer)
    sampler.engine_on_loop = True  # one thread draws from torch's generator: the draws are reproducible
    default = make_rollout_fn(_setup(sampler, tokenizer))

    calls = []

    async def single_calls_only(row):  # the same rollout without its group path
        return await default(row)

    async def counted_group(row, n):
        calls.append(n)
        return await group_rollout_fn(default)(row, n)

    async def with_group_path(row):
        return await default(row)

    setattr(with_group_path, GROUP_ATTRIBUTE, counted_group)

    def sampled(rollout_fn):
        groups = GroupSampler(rollout_fn, G, max_seq_len=64, min_group_size=2, filters=[], vocab_size=len(tokenizer))
        torch.manual_seed(123)

        async def all_rows():
            return await asyncio.gather(*(groups.sample(row, version=0) for row in rows))

        return asyncio.run(all_rows())

    try:
        grouped, single = sampled(with_group_path), sampled(single_calls_only)
    finally:
        sampler.close()
    assert calls == [G] * len(rows)  # one call per row
    for a, b in zip(grouped, single):
        assert len(a.samples) == len(b.samples) == G
        assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]
        assert [s.logprobs for s in a.samples] == [s.logprobs for s in b.samples]
        assert a.rewards == b.rewards
    tokens = [s.tokens for g in grouped for s in g.samples]
    assert len({tuple(t) for t in tokens}) > 1  # sampled, not one completion repeated


def _group_sampler(sample_group, **kwargs) -> GroupSampler:
    async def rollout_fn(row):
        raise AssertionError("the group path must be used")

    setattr(rollout_fn, GROUP_ATTRIBUTE, sample_group)
    return GroupSampler(rollout_fn, G, max_seq_len=64, min_group_size=2, filters=[], **kwargs)


def _sample(reward: float) -> RolloutSample:
    return RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1], reward=reward)


@pytest.mark.timeout(30)
def test_a_failing_group_call_counts_a_failure_and_its_retries_for_each_sample_and_one_failed_row():
    calls = []

    async def sample_group(row, n):
        calls.append(n)
        if len(calls) <= 2:
            raise ConnectionError("server restarting")  # transient: retried
        if row["id"] == 1:
            raise RuntimeError("the environment broke")  # not transient: every sample fails
        return [_sample(float(i % 2)) for i in range(n)]

    groups = _group_sampler(sample_group, max_retries=2)
    import lit_grpo.rollouts.deadlines as deadlines

    backoff, deadlines.RETRY_BACKOFF_S = deadlines.RETRY_BACKOFF_S, 0.01
    try:
        ok = asyncio.run(groups.sample({"id": 0}, version=0))
        failed = asyncio.run(groups.sample({"id": 1}, version=0))
    finally:
        deadlines.RETRY_BACKOFF_S = backoff
    assert calls == [G, G, G, G]  # two retried attempts, then one call per row
    assert ok.rewards == [0.0, 1.0, 0.0, 1.0] and not ok.dropped
    assert failed.samples == [] and failed.dropped == {"rollout/failures": G}
    assert groups.take_counts() == {"rollout/retries": 2 * G, "rollout/failures": G}
    assert groups.breaker.consecutive == 1  # the breaker counts rows: one failed row, whatever its G


@pytest.mark.timeout(30)
def test_a_group_call_past_its_deadline_times_out_every_sample():
    async def sample_group(row, n):
        await asyncio.sleep(30)

    groups = _group_sampler(sample_group, rollout_timeout_s=0.2, max_retries=0)
    start = time.perf_counter()
    group = asyncio.run(groups.sample({"id": 0}, version=0))
    assert time.perf_counter() - start < 5
    assert group.samples == [] and group.dropped == {"rollout/failures": G}
    assert groups.take_counts() == {"rollout/timeouts": G, "rollout/failures": G}


@pytest.mark.timeout(30)
def test_a_group_call_that_returns_the_wrong_number_of_results_is_a_bug_named_by_the_function():
    async def short_group(row, n):
        return [_sample(1.0)] * (n - 1)

    with pytest.raises(TypeError, match=rf"short_group .*returned a list of {G - 1} for a group of {G}"):
        asyncio.run(_group_sampler(short_group).sample({"id": 0}, version=0))


@pytest.mark.timeout(30)
def test_none_and_malformed_results_of_a_group_are_dropped_one_by_one():
    async def sample_group(row, n):
        return [_sample(1.0), None, RolloutSample(tokens=[1], logprobs=[0.0], loss_mask=[0], reward=0.0), _sample(0.0)]

    group = asyncio.run(_group_sampler(sample_group).sample({"id": 0}, version=0))
    assert group.rewards == [1.0, 0.0]
    assert group.dropped == {"rollout/dropped_none": 1, "rollout/dropped_empty_mask": 1}
