"""Lightning callbacks: weight sync, the uniform-reward filter, the reward curve."""

from lit_grpo.callbacks.reward_curve import RewardCurve
from lit_grpo.callbacks.reward_filter import UniformRewardFilter
from lit_grpo.callbacks.weight_sync import WeightSync

__all__ = ["RewardCurve", "UniformRewardFilter", "WeightSync"]
