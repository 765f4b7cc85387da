"""IGPO: turn advantages worked by hand, the HF sampler's `score` against the trainer's logprobs,
and per-token turn advantages reaching the loss on the right tokens."""

import asyncio
import math
from collections import Counter

import pytest
import torch

from lit_grpo.advantages.igpo import information_gains_from_logprobs, turn_advantages, turn_token_advantages
from lit_grpo.advantages.registry import advantage_param_problems, make_advantage
from lit_grpo.config import AdvantageConfig, ConfigError, TrainConfig
from lit_grpo.loop.module import align_to_predictions, token_logprobs
from lit_grpo.maths.losses import policy_loss
from lit_grpo.rollouts.pipeline import checked_samples, make_batch, rollout_metrics
from lit_grpo.samplers.hf import HFSampler
from lit_grpo.types import PromptGroup, RolloutRun, RolloutSample

R2 = math.sqrt(2.0)


@pytest.mark.timeout(10)
def test_turn_advantages_worked_by_hand():
    # Rollout A: IG [2, 0], outcome 1; rollout B: IG [1, 3, -1], outcome 0; gamma 0.5.
    # IG pool [2, 0, 1, 3, -1]: mean 1, population var (1 + 1 + 0 + 4 + 4) / 5 = 2, std √2
    #   -> zIG A [1/√2, -1/√2], B [0, √2, -√2].
    # Outcomes [1, 0]: mean 1/2, std 1/2 -> zOut [1, -1], on each rollout's last turn only.
    # c: A [1/√2, 1 - 1/√2], B [0, √2, -√2 - 1].
    # Returns (ret_T = c_T, ret_t = c_t + 0.5 ret_{t+1}):
    #   A: ret_1 = 1 - 1/√2; ret_0 = 1/√2 + (1 - 1/√2)/2 = 1/2 + 1/(2√2)
    #   B: ret_2 = -√2 - 1; ret_1 = √2 + (-√2 - 1)/2 = √2/2 - 1/2; ret_0 = 0 + (√2/2 - 1/2)/2 = √2/4 - 1/4
    got = turn_advantages([[2.0, 0.0], [1.0, 3.0, -1.0]], [1.0, 0.0], gamma=0.5)
    expected = [[0.5 + 1 / (2 * R2), 1 - 1 / R2], [R2 / 4 - 0.25, R2 / 2 - 0.5, -R2 - 1]]
    for row, want in zip(got, expected):
        assert row == pytest.approx(want, rel=1e-5)  # the std carries eps = 1e-6 (the cookbook's)


@pytest.mark.timeout(10)
def test_turn_advantages_zero_std_gives_zero_scores():
    # Every IG equal: std 0 < eps -> zIG all 0. Outcomes [1, 0] -> zOut [1, -1].
    # A: c [0, 1] -> ret [0 + 0.5·1, 1] = [0.5, 1]; B: c [0, 0, -1] -> ret [-0.25, -0.5, -1].
    got = turn_advantages([[0.3, 0.3], [0.3, 0.3, 0.3]], [1.0, 0.0], gamma=0.5)
    assert got == [pytest.approx([0.5, 1.0], rel=1e-5), pytest.approx([-0.25, -0.5, -1.0], rel=1e-5)]
    # Both streams uniform: no signal anywhere.
    assert turn_advantages([[1.0], [1.0, 1.0]], [2.0, 2.0], gamma=0.5) == [[0.0], [0.0, 0.0]]


@pytest.mark.timeout(10)
def test_skip_last_ig_leaves_the_last_turns_out_of_the_ig_pool():
    # IG pool without the last turns: [2] from A, [1, 3] from B: mean 2, var 2/3, std √(2/3)
    # -> zIG A [0, (last) 0], B [-√1.5, √1.5, (last) 0]; zOut [1, -1]; gamma 0.
    s = math.sqrt(1.5)
    got = turn_advantages([[2.0, 0.0], [1.0, 3.0, -1.0]], [1.0, 0.0], gamma=0.0, skip_last_ig=True)
    assert got == [pytest.approx([0.0, 1.0], abs=1e-5), pytest.approx([-s, s, -1.0], rel=1e-5)]


@pytest.mark.timeout(10)
def test_information_gain_and_token_broadcast():
    # prefix scores: mean of [-2, -4] = -3, of [-1] = -1, of [-1.5, -0.5] = -1 -> IG [2, 0]
    assert information_gains_from_logprobs([[-2.0, -4.0], [-1.0], [-1.5, -0.5]]) == [2.0, 0.0]
    assert turn_token_advantages([1.5, -2.0], [(1, 3), (4, 5)], 6) == [0.0, 1.5, 1.5, 0.0, -2.0, 0.0]


@pytest.mark.timeout(10)
def test_config_validates_the_advantage_fields():
    # IGPO's knobs are the `advantage` group's params, checked by the advantage registry.
    assert TrainConfig().advantage.name == "grpo"
    c = TrainConfig(advantage=AdvantageConfig("igpo", {"gamma": 0.5}))
    assert make_advantage(c.advantage.name, c.advantage.params).params["gamma"] == 0.5
    assert advantage_param_problems("igpo", {"gamma": 1.5}) == [("gamma", "must be in [0, 1], got 1.5")]
    with pytest.raises(ConfigError, match="advantage.name"):
        AdvantageConfig(" ")


@pytest.mark.timeout(120)
def test_hf_score_equals_the_trainers_logprobs(tiny_model, tokenizer, monkeypatch):
    sampler = HFSampler(tiny_model, tokenizer)
    calls, original = [], sampler._score
    monkeypatch.setattr(sampler, "_score", lambda pairs: calls.append(len(pairs)) or original(pairs))
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = [(ids("1+2="), ids("3")), (ids("what is 12+30? "), ids("42 ok")), (ids("x"), ids("hello"))]

    async def run():  # two concurrent calls: one batched forward
        return await asyncio.gather(sampler.score(pairs[:2]), sampler.score(pairs[2:]))

    first, second = asyncio.run(run())
    scores = first + second
    for (prompt, target), got in zip(pairs, scores):
        tokens = torch.tensor([prompt + target])
        want = token_logprobs(tiny_model, tokens, torch.ones_like(tokens), 1.0)[0][0, len(prompt) - 1 :]
        assert len(got) == len(target)
        assert (torch.tensor(got) - want).abs().mean() < 1e-5
    assert calls == [3]
    for again, got in zip(sampler.score_pairs(pairs), scores):
        assert again == pytest.approx(got, abs=1e-6)


def _turn_sample(reward, ig, spans, length):
    """A scripted trajectory: tokens 1..length, trained on the turns' tokens only."""
    mask = [0] * length
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    logprobs = [-0.25 * m for m in mask]
    return RolloutSample(
        list(range(1, length + 1)), logprobs, mask, reward, turn_spans=list(spans), turn_rewards=list(ig)
    )


@pytest.mark.timeout(60)
def test_turn_advantages_reach_the_loss_on_their_turns_tokens():
    # Rollout A (two turns at tokens [2,4) and [6,8)), rollout B as a RolloutRun of two segments,
    # one turn each ([1,3) and [2,5)): the run's turns are its segments' turns, returns discounted across.
    a = _turn_sample(1.0, [2.0, 0.0], [(2, 4), (6, 8)], 9)
    b1, b2 = _turn_sample(0.0, [1.0], [(1, 3)], 4), _turn_sample(0.0, [3.0], [(2, 5)], 6)
    samples, sizes, counts, _ = checked_samples([a, RolloutRun(segments=[b1, b2])], max_seq_len=64)
    assert not counts and sizes == [1, 2]
    group = PromptGroup(row={}, samples=samples, version=0, run_sizes=sizes)
    batch = make_batch(
        [group],
        [group],
        version=0,
        pad_id=0,
        counts=Counter(),
        timings={},
        advantage=make_advantage("igpo", {"gamma": 0.5}),
    )
    returns = turn_advantages([[2.0, 0.0], [1.0, 3.0]], [1.0, 0.0], gamma=0.5)
    assert batch.advantages_BT.shape == batch.tokens_BT.shape == (3, 9)

    # The module's alignment, then an on-policy importance_sampling loss summed over tokens:
    # d loss / d logprob = -A on every trained token, 0 elsewhere.
    mask_BT = align_to_predictions(batch.loss_mask_BT)
    sampler_BT = align_to_predictions(batch.sampler_logprobs_BT)
    logprobs_BT = sampler_BT.clone().requires_grad_(True)
    loss, _ = policy_loss(
        "importance_sampling",
        logprobs=logprobs_BT,
        old_logprobs=logprobs_BT.detach(),
        sampler_logprobs=sampler_BT,
        advantages=align_to_predictions(batch.advantages_BT),
        mask=mask_BT,
        normalization="sum",
        kl_beta=0.0,
    )
    loss.backward()
    expected = torch.zeros(3, 9)
    for row, (spans, values) in enumerate(
        [(a.turn_spans, returns[0]), (b1.turn_spans, returns[1][:1]), (b2.turn_spans, returns[1][1:])]
    ):
        for (start, end), value in zip(spans, values):
            expected[row, start:end] = -value  # token j of the sample is prediction j - 1
    torch.testing.assert_close(logprobs_BT.grad, expected[:, 1:], atol=1e-6, rtol=1e-5)
    assert (logprobs_BT.grad != 0).sum() == mask_BT.sum()  # every trained token, and only those
    # advantages_B: the mean of each sequence's per-token advantages on its trained tokens, for logs.
    assert batch.advantages_B.tolist() == pytest.approx([sum(returns[0]) / 2, returns[1][0], returns[1][1]], rel=1e-5)
    # The step's IGPO metrics, by hand: run A's gains [2, 0], run B's [1, 3] (its two segments).
    metrics = rollout_metrics([batch.record])
    assert metrics["igpo/turns"] == 2.0  # two turns each
    assert metrics["igpo/positive_ig_frac"] == pytest.approx((1 / 2 + 2 / 2) / 2)  # A: one of two > 0; B: both
    assert metrics["igpo/ig_turn_0"] == pytest.approx((2.0 + 1.0) / 2) and metrics["igpo/ig_turn_1"] == pytest.approx(
        (0.0 + 3.0) / 2
    )
    assert metrics["reward/mean"] == pytest.approx(0.5)  # the outcome reward, per run


@pytest.mark.timeout(30)
def test_malformed_turns_are_dropped_and_default_batches_are_unchanged():
    good = _turn_sample(1.0, [0.5], [(1, 3)], 4)
    overlapping = _turn_sample(1.0, [0.5, 0.1], [(1, 3), (2, 4)], 4)
    missing_rewards = RolloutSample([1, 2, 3], [0.0, -0.1, -0.1], [0, 1, 1], 1.0, turn_spans=[(1, 3)])
    _, _, counts, _ = checked_samples([good, overlapping, missing_rewards], max_seq_len=64)
    assert counts == Counter({"rollout/dropped_bad_turns": 2})
    group = PromptGroup(row={}, samples=[good, _turn_sample(0.0, [0.1], [(1, 3)], 4)], version=0)
    batch = make_batch([group], [group], version=0, pad_id=0, counts=Counter(), timings={})
    assert batch.advantages_BT is None and batch.advantages_B.shape == (2,)
