"""Reward of the message-in example: 1.0 for the right sum, 0.5 for any number, else 0."""

from __future__ import annotations


def sum_reward(completion: str, answer: str) -> float:
    text = completion.strip()
    if text == str(answer):
        return 1.0
    return 0.5 if text[:1].isdigit() else 0.0
