"""Optional extras, as Lightning callbacks: the uniform-reward filter, the reward curve,
histograms, the sample log, and the final export (made by `lit_grpo.train` from `output_model_id`).

Dropping any of them never stalls training or changes its maths: the end of a step (weight sync
and policy version, checkpoint, evaluation, metrics) is `lit_grpo.loop.step_sequence`.
"""

from lit_grpo.callbacks.reward_curve import RewardCurve
from lit_grpo.callbacks.reward_filter import UniformRewardFilter
from lit_grpo.callbacks.reward_histogram import RewardHistogram
from lit_grpo.callbacks.sample_log import SampleLog

__all__ = ["RewardCurve", "RewardHistogram", "SampleLog", "UniformRewardFilter"]
