"""The exact-match reward: the whole completion against the row's `answer`."""

from __future__ import annotations

from lit_grpo.rewards.registry import inline_reward, reference_field, register_reward


@register_reward("exact_match")
@inline_reward
def exact_match(completion_text: str, row: dict) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals `str(row["answer"])`
    stripped; else 0.0. The row's `answer` field is the reference (a number is compared as its str)."""
    return 1.0 if completion_text.strip() == str(row[reference_field(row, ("answer",), "exact_match")]).strip() else 0.0
