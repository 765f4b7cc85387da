"""Rewards: `reward(completion_text, row) -> float | None` (or `async def`), a registry of them
(`registry.py`), the run's reward, one of them or a weighted sum (`combine.py`), and how a
completion is scored: concurrently, under a limit, each call under a deadline (`scoring.py`).

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
    inline_reward,
    register_reward,
    reward_name,
)
from lit_grpo.rewards.scoring import RewardScorer, Scored, is_async_reward, reward_scorer

__all__ = [
    "REWARDS", "RewardFn", "RewardRowError", "RewardScorer", "Scored", "WeightedReward", "available_rewards",
    "build_reward", "get_reward", "inline_reward", "is_async_reward", "register_reward", "reward_name",
    "reward_scorer", "score_with_parts",
]  # fmt: skip
