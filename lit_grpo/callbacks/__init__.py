"""Lightning callbacks: weight sync, the uniform-reward filter, the reward curve and histograms,
greedy evaluation, DCP checkpoints and the final export (the last two are made by `lit_grpo.train`)."""

from lit_grpo.callbacks.evaluation import GreedyEvaluation
from lit_grpo.callbacks.reward_curve import RewardCurve
from lit_grpo.callbacks.reward_filter import UniformRewardFilter
from lit_grpo.callbacks.reward_histogram import RewardHistogram
from lit_grpo.callbacks.weight_sync import WeightSync

__all__ = ["GreedyEvaluation", "RewardCurve", "RewardHistogram", "UniformRewardFilter", "WeightSync"]
