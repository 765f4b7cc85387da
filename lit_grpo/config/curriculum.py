"""The `curriculum` group: which rows are drawn, following each row's online pass rate.

`none` (the default) is the row cursor of every run: each row once per epoch, in a seeded order.
`pools` and `fn` draw rows with replacement, weighted by each row's statistics (times drawn, pass
rate), which every rank merges after each step (`lit_grpo.rollouts.curriculum`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lit_grpo.config.checks import DEFINES_STATE, require, require_finite

CURRICULUM_KINDS = ("none", "pools", "fn")
POOLS = ("easy", "normal", "hard")


@dataclass
class CurriculumConfig:
    """How rows are drawn: all alike (`none`), or weighted by their online pass rate."""

    kind: str = field(default="none", metadata=DEFINES_STATE)
    """`none`: every row once per epoch (the row cursor); `pools`: rows drawn with replacement,
    weighted by their pool (easy, normal, hard by pass rate; `pool_weights`); `fn`: weighted by
    `curriculum.fn`."""
    pass_reward: float = 1.0
    """A completion passes when its reward is >= this (the arithmetic and gsm8k rewards give 1.0 for a right answer)."""
    pass_rate_ema: float = 0.5
    """Weight of a row's newest group in its pass rate: rate = (1 - w)·rate + w·(passes / samples of
    the group); a row's first group sets it. 1.0: the last group alone; small: a long memory."""
    easy_above: float = 0.9
    """A row whose pass rate is >= this is in the easy pool."""
    hard_below: float = 0.1
    """A row whose pass rate is <= this is in the hard pool (rows never drawn are normal)."""
    pool_weights: dict = field(default_factory=lambda: {"easy": 0.1, "normal": 1.0, "hard": 0.5})
    """Draw weight of one row of each pool (`easy`, `normal`, `hard`): a row is drawn with
    probability its weight over the sum of all live rows' weights. 0 never draws that pool."""
    retire_after: int = 0
    """A row whose group passed on every completion this many times is never drawn again (0: never retire)."""
    fn: Optional[str] = None
    """With `kind: fn`: `module:function` taking the rows' statistics (a list of `RowStats`, one per
    row of the dataset) and returning one draw weight (>= 0) per row; called after every step."""

    def __post_init__(self) -> None:
        require(
            self.kind in CURRICULUM_KINDS,
            "curriculum.kind",
            f"must be one of {', '.join(CURRICULUM_KINDS)}, got {self.kind!r}",
        )
        require_finite(self.pass_reward, "curriculum.pass_reward")
        require_finite(self.pass_rate_ema, "curriculum.pass_rate_ema")
        require(0 < self.pass_rate_ema <= 1, "curriculum.pass_rate_ema", f"must be in (0, 1], got {self.pass_rate_ema}")
        require_finite(self.easy_above, "curriculum.easy_above")
        require_finite(self.hard_below, "curriculum.hard_below")
        require(
            0 <= self.hard_below < self.easy_above <= 1,
            "curriculum.easy_above",
            f"needs 0 <= curriculum.hard_below < easy_above <= 1, got hard_below={self.hard_below}, "
            f"easy_above={self.easy_above}",
        )
        weights = dict(self.pool_weights)
        require(
            set(weights) == set(POOLS),
            "curriculum.pool_weights",
            f"must name exactly the pools {', '.join(POOLS)}, got {', '.join(map(str, weights)) or 'none'}",
        )
        for pool in POOLS:
            require_finite(weights[pool], f"curriculum.pool_weights.{pool}")
            require(weights[pool] >= 0, f"curriculum.pool_weights.{pool}", f"must be >= 0, got {weights[pool]}")
        require(any(weights[p] > 0 for p in POOLS), "curriculum.pool_weights", "at least one pool needs a weight > 0")
        require(
            isinstance(self.retire_after, int) and self.retire_after >= 0,
            "curriculum.retire_after",
            f"must be an integer >= 0 (0: never retire), got {self.retire_after!r}",
        )
        require(
            (self.fn is not None) == (self.kind == "fn"),
            "curriculum.fn",
            "must be 'module:function' with curriculum.kind=fn, and null otherwise"
            f" (kind={self.kind!r}, fn={self.fn!r})",
        )
        require(
            self.kind != "none" or self.retire_after == 0,
            "curriculum.retire_after",
            "needs curriculum.kind pools or fn: with kind none every row is drawn once per epoch",
        )
