"""Rewards: `reward(completion_text, row) -> float | None`, a registry of them (`registry.py`),
and the run's reward, one of them or a weighted sum (`combine.py`).

Built-ins: `arithmetic` (the demo's leading-number match), `gsm8k` (final-number match) and
`exact_match` (the whole completion, stripped).
"""

from lit_grpo.rewards import arithmetic, exact_match, gsm8k  # noqa: F401  (registers the built-ins)
from lit_grpo.rewards.combine import WeightedReward, build_reward, score_with_parts
from lit_grpo.rewards.registry import (
    REWARDS,
    RewardFn,
    RewardRowError,
    available_rewards,
    get_reward,
    register_reward,
    reward_name,
)

__all__ = [
    "REWARDS", "RewardFn", "RewardRowError", "WeightedReward", "available_rewards", "build_reward", "get_reward",
    "register_reward", "reward_name", "score_with_parts",
]  # fmt: skip
