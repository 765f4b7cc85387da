"""Length controls (`rollout.mask_truncated`, DAPO's soft overlong penalty): the penalty against
hand-worked values, the loss masks and advantages of a masked batch, the metrics, the config
checks, and a short real run with both switches on."""

import asyncio
import csv
from collections import Counter

import pytest
import torch
from conftest import compose_config

from lit_grpo.config import ConfigError, ineffective_knobs
from lit_grpo.rollouts import GroupSampler, make_batch, rollout_metrics
from lit_grpo.rollouts.pipeline import overlong_penalty, penalize_overlong
from lit_grpo.run.validate import validate
from lit_grpo.train import train
from lit_grpo.types import PromptGroup, RolloutRun, RolloutSample


def _sample(generated: int, reward: float, finish_reason: str = "stop", prompt: int = 2) -> RolloutSample:
    """A sample of `prompt` prompt tokens then `generated` loss-masked ones."""
    mask = [0] * prompt + [1] * generated
    return RolloutSample(
        tokens=list(range(1, len(mask) + 1)),
        logprobs=[-0.5 * m for m in mask],
        loss_mask=mask,
        reward=reward,
        finish_reason=finish_reason,
    )


# ------------------------------------------------------------------ the overlong penalty


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "length, expected",
    [
        (10, 0.0),  # well below the buffer's start (L_max - buffer = 16)
        (16, 0.0),  # exactly at the start: (20 - 4 - 16) / 4 = 0
        (18, -0.5 * 2.0),  # halfway through the buffer: (16 - 18) / 4 = -0.5, times the factor 2
        (19, -0.75 * 2.0),
        (20, -1.0 * 2.0),  # at L_max: -factor
        (27, -1.0 * 2.0),  # beyond L_max (a run of several calls): still -factor, as DAPO's eq. 13
    ],
)
def test_overlong_penalty_by_hand(length, expected):
    assert overlong_penalty(length, max_length=20, buffer_len=4, factor=2.0) == expected


@pytest.mark.timeout(60)
def test_overlong_penalty_is_off_with_no_buffer():
    assert overlong_penalty(20, max_length=20, buffer_len=0, factor=2.0) == 0.0


@pytest.mark.timeout(60)
def test_a_runs_penalty_counts_the_generated_tokens_of_all_its_segments():
    # L_max = 8, buffer 4: the penalty starts after 4 tokens and reaches -1 at 8.
    # Run 1: one sample of 3 generated tokens -> 0.  Run 2: segments of 3 and 3 generated tokens
    # (prompt tokens not counted) -> L = 6: (8 - 4 - 6) / 4 = -0.5, on both segments.
    # Run 3: 5 tokens -> -0.25.
    samples = [_sample(3, 1.0), _sample(3, 0.5, prompt=5), _sample(3, 0.5), _sample(5, 1.0)]
    out = penalize_overlong(samples, [1, 2, 1], max_length=8, buffer_len=4, factor=1.0)
    assert [s.reward for s in out] == [1.0, 0.0, 0.0, 0.75]
    assert [s.metrics["reward/overlong_penalty"] for s in out] == [0.0, -0.5, -0.5, -0.25]
    assert [s.reward for s in samples] == [1.0, 0.5, 0.5, 1.0]  # the rollout's own objects are untouched
    assert all(s.metrics == {} for s in samples)


@pytest.mark.timeout(60)
def test_the_group_sampler_penalizes_every_rollout_result_before_the_group_sees_it():
    # A user's rollout function returning a plain sample, then a RolloutRun of two segments.
    results = iter(
        [_sample(2, 1.0), RolloutRun(segments=[_sample(2, 1.0), _sample(2, 1.0, "length")]), _sample(4, 0.0, "length")]
    )

    async def rollout_fn(row):
        return next(results)

    groups = GroupSampler(
        rollout_fn,
        3,
        max_seq_len=64,
        min_group_size=2,
        filters=[],
        max_completion_tokens=4,
        overlong_buffer_len=2,
        overlong_penalty_factor=0.5,
    )
    group = asyncio.run(groups.sample({"id": 0}, version=0))
    # L = 2: (4 - 2 - 2) / 2 = 0; the run: L = 4 -> -1 * 0.5; the last: L = 4 -> -0.5.
    assert sorted(group.rewards) == [-0.5, 0.5, 1.0]
    assert sorted(s.reward for s in group.samples) == [-0.5, 0.5, 0.5, 1.0]  # both segments of the run


# ------------------------------------------------------------------ mask_truncated


def _groups() -> list[PromptGroup]:
    # Group a: rewards [1, 0, 0.5], the middle truncated. Group b: a run of two segments (the
    # second truncated) and a plain truncated sample.
    a = PromptGroup(row={}, version=0, samples=[_sample(2, 1.0), _sample(3, 0.0, "length"), _sample(1, 0.5)])
    b = PromptGroup(
        row={},
        version=0,
        samples=[_sample(2, 1.0), _sample(3, 1.0, "length"), _sample(3, 0.0, "length")],
        run_sizes=[2, 1],
    )
    return [a, b]


@pytest.mark.timeout(60)
def test_mask_truncated_zeroes_exactly_the_truncated_rows_and_keeps_their_advantages():
    plain = make_batch(_groups(), _groups(), version=0, pad_id=0, counts=Counter(), timings={})
    masked = make_batch(_groups(), _groups(), version=0, pad_id=0, counts=Counter(), timings={}, mask_truncated=True)
    truncated = torch.tensor([False, True, False, False, True, True])
    assert (masked.loss_mask_BT[truncated] == 0).all()
    assert (masked.sampler_logprobs_BT[truncated] == 0).all()
    assert torch.equal(masked.loss_mask_BT[~truncated], plain.loss_mask_BT[~truncated])
    assert torch.equal(masked.sampler_logprobs_BT[~truncated], plain.sampler_logprobs_BT[~truncated])
    assert plain.loss_mask_BT[truncated].sum() == 3 + 3 + 3  # there was something to mask
    # Rewards and advantages are as sampled: the truncated sequences still count in their group.
    assert torch.equal(masked.rewards_B, plain.rewards_B)
    assert torch.equal(masked.advantages_B, plain.advantages_B)
    # Group a, grpo: mean 0.5, std 0.5 -> the masked middle row keeps (0 - 0.5) / 0.5 = -1.
    assert masked.advantages_B[1].item() == pytest.approx(-1.0, abs=1e-5)
    assert masked.advantages_B[0].item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.timeout(60)
def test_the_masked_fraction_metric_pools_ranks_and_is_absent_when_off():
    masked = make_batch(_groups(), _groups(), version=0, pad_id=0, counts=Counter(), timings={}, mask_truncated=True)
    assert masked.record.truncated_masked == 3
    clean = PromptGroup(row={}, version=0, samples=[_sample(2, 1.0), _sample(2, 0.0)])
    other_rank = make_batch([clean], [clean], version=0, pad_id=0, counts=Counter(), timings={}, mask_truncated=True)
    assert other_rank.record.truncated_masked == 0
    # 3 masked of 6 + 2 trained sequences.
    m = rollout_metrics([masked.record, other_rank.record])
    assert m["rollout/truncated_masked_frac"] == pytest.approx(3 / 8)
    assert m["rollout/truncated_frac"] == pytest.approx(3 / 8)
    plain = make_batch(_groups(), _groups(), version=0, pad_id=0, counts=Counter(), timings={})
    assert plain.record.truncated_masked is None
    assert "rollout/truncated_masked_frac" not in rollout_metrics([plain.record])


# ------------------------------------------------------------------ config


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides, field",
    [
        (["rollout.overlong_buffer_len=-1"], "rollout.overlong_buffer_len"),
        (["sampler.max_completion_tokens=8", "rollout.overlong_buffer_len=8"], "rollout.overlong_buffer_len"),
        (["rollout.overlong_penalty_factor=nan"], "rollout.overlong_penalty_factor"),
        (["rollout.overlong_penalty_factor=inf"], "rollout.overlong_penalty_factor"),
        (["rollout.overlong_penalty_factor=-1"], "rollout.overlong_penalty_factor"),
    ],
)
def test_bad_length_controls_fail_validation_naming_the_field(overrides, field, tmp_path):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(compose_config(*overrides, output_dir=tmp_path))


@pytest.mark.timeout(120)
def test_both_switches_are_off_by_default_and_a_buffer_below_the_limit_validates(tmp_path):
    c = validate(compose_config(output_dir=tmp_path))
    r = c.rollout
    assert (r.mask_truncated, r.overlong_buffer_len, r.overlong_penalty_factor) == (False, 0, 1.0)
    c = validate(
        compose_config("sampler.max_completion_tokens=8", "rollout.overlong_buffer_len=7", output_dir=tmp_path)
    )
    assert c.rollout.overlong_buffer_len == 7
    assert ineffective_knobs(c) == []


@pytest.mark.timeout(120)
def test_a_penalty_factor_without_a_buffer_is_named_as_ineffective(tmp_path):
    [knob] = ineffective_knobs(validate(compose_config("rollout.overlong_penalty_factor=2.0", output_dir=tmp_path)))
    assert "rollout.overlong_penalty_factor=2.0" in knob and "overlong_buffer_len=0" in knob


# ------------------------------------------------------------------ the real training loop


@pytest.mark.timeout(900)
def test_both_switches_in_a_two_step_run(tmp_path):
    # Completions of at most 3 tokens, the penalty over the last 2: every sequence that hits the
    # limit is truncated (-1) and masked; the answers of arithmetic are 1-3 characters long.
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=2",
            "sampler.max_completion_tokens=3",
            "rollout.mask_truncated=true",
            "rollout.overlong_buffer_len=2",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 2
    with open(tmp_path / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    steps = [row for row in rows if "train/loss" in row]
    assert len(steps) == 2
    for step in steps:
        # A random-init model mostly runs to the limit: there is something to mask and penalize.
        assert step["rollout/truncated_frac"] > 0
        # Every trained truncated sequence is masked ...
        assert step["rollout/truncated_masked_frac"] == step["rollout/truncated_frac"]
        # ... so the step trains only the tokens of the sequences that stopped (G = 8 per group).
        stopped = step["rollout/groups_accepted"] * 8 * (1 - step["rollout/truncated_frac"])
        assert step["train/tokens"] == pytest.approx(stopped * step.get("rollout/length_stop", 0.0))
        # L in {1, 2, 3} with L_max = 3, buffer 2: penalties 0, -0.5, -1; truncated ones are -1.
        assert -1.0 <= step["reward/overlong_penalty"] < 0.0
