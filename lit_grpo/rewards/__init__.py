"""Reward functions: `score(completion_text, answer) -> float`."""
