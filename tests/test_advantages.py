"""Group-relative advantages against values worked out by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from lit_grpo.maths.advantages import group_advantages, ragged_group_advantages


def test_std_scaled_by_hand():
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 · 0.25) / 3) = 0.57735 -> ±0.5 / 0.57735 = ±0.866025.
    # Group [2, 0]: mean 1, unbiased std sqrt(2) -> ±1/sqrt(2).
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert_close(group_advantages(rewards), torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-5, rtol=0)
    assert_close(group_advantages(torch.tensor([[2.0, 0.0]])), torch.tensor([[1 / math.sqrt(2), -1 / math.sqrt(2)]]))


def test_one_right_of_four():
    # [1, 0, 0, 0]: mean 0.25, std sqrt((0.5625 + 3 · 0.0625) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5].
    assert_close(group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]])), torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_uniform_group_is_all_zero_and_others_unaffected():
    rewards = torch.tensor([[0.7, 0.7, 0.7], [3.0, 1.0, 2.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    # [3, 1, 2]: mean 2, std 1 -> [1, -1, 0].
    assert_close(adv[1], torch.tensor([1.0, -1.0, 0.0]))


def test_dr_grpo_only_centres():
    assert_close(group_advantages(torch.tensor([[3.0, 1.0, 2.0, 2.0]]), scale="none"), torch.tensor([[1.0, -1.0, 0.0, 0.0]]))


def test_ragged_groups_match_per_group_computation():
    got = ragged_group_advantages([[1.0, 0.0, 0.0, 0.0], [2.0, 0.0], [0.0, 1.0, 1.0, 1.0], [3.0, 3.0]])
    assert got[0] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert got[1] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)])
    assert got[2] == pytest.approx([-1.5, 0.5, 0.5, 0.5])  # same size as group 0: batched with it, order kept
    assert got[3] == [0.0, 0.0]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="valid: std, none"):
        group_advantages(torch.tensor([[1.0, 0.0]]), scale="rank")


def test_huge_rewards_do_not_overflow_the_std():
    # Rewards 2e200 and 0: mean 1e200, unbiased std sqrt(2)·1e200, so A = ±1/sqrt(2) (not 0 from an inf std).
    adv = group_advantages(torch.tensor([[2e200, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[2 ** -0.5, -(2 ** -0.5)]]))
