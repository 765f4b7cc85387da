"""Reward of the multi-turn example: exact answer, discounted by the turns it took."""

from lit_grpo.rewards.arithmetic import score


def turn_reward(completion: str, answer: str, turn: int, discount: float = 0.5) -> float:
    """1 for a right answer on the first turn, `discount` on the second, and so on; 0 if wrong."""
    return score(completion, answer) * discount**turn
