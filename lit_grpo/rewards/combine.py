"""The run's reward: the task's own, or `reward.fn`'s components in a weighted sum.

With several components each one's value of a sample is also put in the sample's `metrics`
under `reward/<name>` (the default rollout does it), so a run logs one curve per component
beside `reward/mean` of the sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from lit_grpo.config.groups import REWARD_MODEL
from lit_grpo.rewards.registry import RewardFn, get_reward, reward_name

if TYPE_CHECKING:
    from lit_grpo.config import RewardConfig

RESERVED_NAMES = ("mean", "std", "max", "histogram")
"""`reward/<name>` keys the run logs already: no component may take them."""


def as_number(name: str, value: Any) -> Optional[float]:
    """A weighted component's value as a float (None stays None); anything else is a bug in
    reward `name`: a TypeError that stops the run with this message."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"reward {name!r} returned {type(value).__name__} {str(value)[:40]!r}, not a number or None"
        ) from None


def part_key(name: str) -> str:
    """The metric of one component of a weighted reward, `reward/<name>`."""
    return f"reward/{name}"


class WeightedReward:
    """`reward(completion_text, row)`: Σ weight·value over the components that return a number
    (a None is skipped: not applicable); None when none does. Callable like any reward, so a
    rollout of your own can use it as is; `score` also returns each component's value."""

    def __init__(self, components: list[tuple[str, RewardFn]], weights: list[float]) -> None:
        if len(components) != len(weights):
            raise ValueError(f"{len(components)} reward components but {len(weights)} weights")
        self.components, self.weights = list(components), [float(w) for w in weights]

    def score(self, completion_text: str, row: dict) -> tuple[Optional[float], dict[str, float]]:
        """The weighted sum (None when every component returned None) and, with more than one
        component, `{"reward/<name>": value}` of those that returned a number."""
        return self.combine([fn(completion_text, row) for _, fn in self.components])

    def combine(self, values: list[object]) -> tuple[Optional[float], dict[str, float]]:
        """`score` of the components' values, given in order (`lit_grpo.rewards.scoring` computes
        them concurrently); a value that is neither a number nor None is a bug in its reward."""
        total, parts = 0.0, {}
        for (name, _), weight, value in zip(self.components, self.weights, values):
            number = as_number(name, value)
            if number is None:
                continue
            parts[part_key(name)] = number
            total += weight * number
        if not parts:
            return None, {}
        return total, (parts if len(self.components) > 1 else {})

    def __call__(self, completion_text: str, row: dict) -> Optional[float]:
        return self.score(completion_text, row)[0]

    def __repr__(self) -> str:
        return "WeightedReward(" + ", ".join(f"{w:g}·{n}" for (n, _), w in zip(self.components, self.weights)) + ")"


def score_with_parts(reward_fn: RewardFn, completion_text: str, row: dict) -> tuple[Optional[float], dict[str, float]]:
    """`reward_fn`'s value and its per-component metrics (none for a plain reward function)."""
    if isinstance(reward_fn, WeightedReward):
        return reward_fn.score(completion_text, row)
    return reward_fn(completion_text, row), {}


def component_names(specs: list[str]) -> list[str]:
    """The short names of `reward.fn`'s components (`reward_name`), in order."""
    return [reward_name(s) for s in specs]


def build_reward(
    cfg: RewardConfig,
    task_reward: Callable[[], RewardFn],
    task_name: str,
    reward_model: Optional[Callable[[], RewardFn]] = None,
) -> RewardFn:
    """The run's reward: the task's (`task_reward()`) when `reward.fn`, `reward.weights` and
    `reward.model` are null, else a `WeightedReward` of `reward.fn`'s components (the task's alone
    when only the weights are set). The component `reward_model` is `reward_model()`
    (`lit_grpo.rewards.reward_model.reward_model_reward`, which the run's task layer calls with the
    rows' prompt field)."""
    specs = cfg.specs()
    if not specs and cfg.weights is None:
        return task_reward()

    def component(spec: str) -> RewardFn:
        if spec != REWARD_MODEL:
            return get_reward(spec)
        if reward_model is None:
            raise ValueError(f"reward.fn names {REWARD_MODEL!r}: build_reward needs reward_model= to build it")
        return reward_model()

    components = (
        [(n, component(s)) for n, s in zip(component_names(specs), specs)] if specs else [(task_name, task_reward())]
    )
    weights = cfg.weights if cfg.weights is not None else [1.0] * len(components)
    return WeightedReward(components, weights)


def check_weights(weights: Optional[list[float]], count: int) -> Optional[str]:
    """Why `reward.weights` does not fit `count` components, or None."""
    if weights is None:
        return None
    if len(weights) != count:
        return (
            f"has {len(weights)} weight{'s' * (len(weights) != 1)} for {count} reward component{'s' * (count != 1)} "
            "(reward.fn); give one per component"
        )
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
        return f"must be finite numbers, got {list(weights)}"
    return None
