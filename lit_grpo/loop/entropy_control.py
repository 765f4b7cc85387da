"""The entropy bonus's coefficient over a run and the entropy alarm (`entropy.*` in the config).

The coefficient is fixed, decays linearly, or adapts to each step's mean entropy
(`lit_grpo.maths.entropy`); the adaptive one is state, saved in checkpoints so a resumed run
continues with the coefficient it had. The alarm warns once when the step's mean entropy leaves
[floor, ceiling] and logs `train/entropy_alarm` every step it is outside.
"""

from __future__ import annotations

import logging
from typing import Optional

from lit_grpo.config import EntropyConfig
from lit_grpo.maths.entropy import adapted_entropy_coef, scheduled_entropy_coef

log = logging.getLogger(__name__)


class EntropyControl:
    def __init__(self, config: EntropyConfig) -> None:
        self.config = config
        self.adaptive_coef = config.coef
        """The adaptive bonus's current coefficient (unused without `entropy.target`)."""
        self.warned = False

    def coef(self, step: int) -> float:
        """The bonus coefficient for rollout step `step` (0-based)."""
        c = self.config
        if c.adaptive:
            return self.adaptive_coef
        return scheduled_entropy_coef(step, coef=c.coef, coef_final=c.coef_final, decay_steps=c.decay_steps)

    def after_step(self, entropy: float, *, warn: bool) -> dict[str, float]:
        """Given the step's mean entropy over every rank's masked tokens: move the adaptive
        coefficient, sound the alarm (`warn`: this process logs the warning); returns the metrics."""
        c = self.config
        metrics: dict[str, float] = {}
        if c.target is not None:  # adaptive
            metrics["train/entropy/coef"] = self.adaptive_coef  # the coefficient this step trained with
            self.adaptive_coef = adapted_entropy_coef(
                self.adaptive_coef, entropy, target=c.target, step_size=c.adapt_step, coef_max=c.coef_max
            )
        if c.floor is not None or c.ceiling is not None:
            outside = (c.floor is not None and entropy < c.floor) or (c.ceiling is not None and entropy > c.ceiling)
            metrics["train/entropy_alarm"] = float(outside)
            if outside and warn and not self.warned:
                self.warned = True
                side = "below entropy.floor" if c.floor is not None and entropy < c.floor else "above entropy.ceiling"
                log.warning(
                    "the policy's mean entropy %.4g is %s (%s); %s. Warned once; train/entropy_alarm logs each step",
                    entropy,
                    side,
                    c.floor if c.floor is not None and entropy < c.floor else c.ceiling,
                    "entropy collapse: try entropy.coef, entropy.target or a higher sampler.temperature"
                    if side.startswith("below")
                    else "the policy is spreading out: lower the learning rate or the entropy bonus",
                )
        return metrics

    def state_dict(self) -> dict[str, float]:
        return {"adaptive_coef": float(self.adaptive_coef)} if self.config.adaptive else {}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state and "adaptive_coef" in state:
            self.adaptive_coef = float(state["adaptive_coef"])
