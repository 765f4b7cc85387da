"""The controls applied around every policy loss alike: the training–inference mismatch correction
(`correction=<mode>`, `conf/correction/<mode>.yaml`), the entropy controls (`entropy.*`) and the
KL reference's schedule (`reference.*`).
The maths is `lit_grpo.maths.correction`, `lit_grpo.maths.entropy` and `lit_grpo.models.reference`;
the mode names and their parameters are checked against the correction registry in `lit_grpo.run.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.config.checks import DEFINES_STATE, require, require_finite

CORRECTION_PARAMS = ("level", "cap", "low", "high", "estimator", "threshold")
"""CorrectionConfig's fields that are a mode's parameters (the registry says which mode takes which)."""


@dataclass
class CorrectionConfig:
    """How the loss corrects for the sampler not being the trainer: every mode weighs or drops
    tokens by r = exp(old − sampler), the trainer's probability of a token before this batch's
    update over the sampler's. Parameters left null take the mode's registered default."""

    name: str = "tis"
    """none | tis (min(r, cap); the default, as the cookbook's TISConfig) | mask (r, or 0 past the cap:
    TRL's) | icepop (r inside [low, high], else 0) | geo_mask (a sequence whose geometric mean of
    1/r = sampler/old is outside [low, high] is dropped, verl's seq_mean_k1 orientation) | kl_reject
    (a token or sequence whose KL estimate passes `threshold` is dropped) | `module.path:name` for a
    user's mode."""
    level: Optional[str] = None
    """`token`: each token its own r; `sequence`: the sequence's geometric-mean r (tis, mask, kl_reject)."""
    cap: Optional[float] = None
    """tis: the truncation (default 5.0); mask: the largest kept ratio (default 3.0)."""
    low: Optional[float] = None
    """icepop: the band's lower edge on r; geo_mask: on sampler/old (kept, inclusive)."""
    high: Optional[float] = None
    """icepop: the band's upper edge on r; geo_mask: on sampler/old (kept, inclusive)."""
    estimator: Optional[str] = None
    """kl_reject: k1 | k2 | k3, the estimate of KL(sampler ‖ trainer) compared with `threshold`."""
    threshold: Optional[float] = None
    """kl_reject: the largest kept KL estimate."""
    off_policy_delta: Optional[float] = None
    """DeepSeek-V3.2's off-policy mask, a switch apart from the mode (null: off): the tokens with
    A < 0 of a sequence whose mean log-ratio sampler − current policy exceeds δ are dropped."""

    def params(self) -> dict[str, Any]:
        """The mode's parameters that are set (the others take the registered defaults)."""
        return {key: getattr(self, key) for key in CORRECTION_PARAMS if getattr(self, key) is not None}

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(self.name.strip()), "correction.name", "must name a correction mode"
        )
        for key in ("cap", "low", "high", "threshold", "off_policy_delta"):
            if getattr(self, key) is not None:
                require_finite(getattr(self, key), f"correction.{key}")
        if self.off_policy_delta is not None:
            require(self.off_policy_delta >= 0, "correction.off_policy_delta", "must be >= 0 (null: off)")


@dataclass
class EntropyConfig:
    """Acting on the policy's entropy (it is logged as `train/entropy` either way): a bonus, fixed,
    decaying or adaptive; training on the high-entropy tokens only; an alarm. All off by default."""

    coef: float = 0.0
    """The entropy bonus: `− coef·H_t` is added to each token's loss (0: off). The entropy is then
    differentiated (a second float32 chunk in the logprob backward)."""
    coef_final: Optional[float] = None
    """With `decay_steps` > 0: the bonus moves linearly from `coef` to this over that many rollout steps."""
    decay_steps: int = 0
    """Rollout steps of the linear decay to `coef_final` (0: no decay)."""
    target: Optional[float] = None
    """Adaptive bonus (null: off): the coefficient rises by `adapt_step` after a step whose mean
    entropy was below the target and falls otherwise, within [0, coef_max] (Skywork-OR1); it starts at `coef`."""
    adapt_step: float = 0.001
    """The adaptive coefficient's change per rollout step."""
    coef_max: float = 0.05
    """The adaptive coefficient's ceiling."""
    top_quantile: Optional[float] = None
    """Train the policy term only on the tokens whose entropy is in the top q of each micro-batch's
    loss-masked tokens (null: all tokens; 0.2: the "80/20" paper's)."""
    floor: Optional[float] = None
    """The alarm: a warning (once) and `train/entropy_alarm` = 1 when the step's mean entropy falls below this."""
    ceiling: Optional[float] = None
    """The alarm's upper side: the same when the step's mean entropy rises past this."""

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    @property
    def differentiated(self) -> bool:
        """Whether the loss differentiates the entropy (a bonus is or may become non-zero)."""
        return self.coef != 0 or self.adaptive or bool(self.coef_final)

    @property
    def watched(self) -> bool:
        """Whether each step's global mean entropy is needed (the adaptive bonus, the alarm)."""
        return self.adaptive or self.floor is not None or self.ceiling is not None

    def __post_init__(self) -> None:
        for key in ("coef", "coef_final", "target", "adapt_step", "coef_max", "floor", "ceiling"):
            if getattr(self, key) is not None:
                require_finite(getattr(self, key), f"entropy.{key}")
        require(self.coef >= 0, "entropy.coef", f"must be >= 0 (0: no bonus), got {self.coef}")
        final = self.coef_final
        require(final is None or final >= 0, "entropy.coef_final", f"must be >= 0, got {final}")
        require(self.decay_steps >= 0, "entropy.decay_steps", f"must be >= 0, got {self.decay_steps}")
        require(
            not (self.adaptive and self.decay_steps > 0),
            "entropy.decay_steps",
            "cannot go with the adaptive bonus (entropy.target): choose a decay or a target",
        )
        require(self.target is None or self.target > 0, "entropy.target", f"must be > 0, got {self.target}")
        require(self.adapt_step > 0, "entropy.adapt_step", f"must be > 0, got {self.adapt_step}")
        require(
            not self.adaptive or self.coef_max >= self.coef,
            "entropy.coef_max",
            f"must be >= entropy.coef ({self.coef}), where the adaptive coefficient starts",
        )
        require(
            self.top_quantile is None or 0 < self.top_quantile <= 1,
            "entropy.top_quantile",
            f"must be in (0, 1] (null: every token), got {self.top_quantile}",
        )
        require(
            self.floor is None or self.ceiling is None or self.floor < self.ceiling,
            "entropy.floor",
            f"must be below entropy.ceiling ({self.ceiling}), got {self.floor}",
        )


@dataclass
class ReferenceConfig:
    """The KL reference's schedule (it exists only with `policy_loss.kl_beta > 0`): frozen at the
    initial policy (the default), or moved towards the policy every `sync_every` optimizer steps,
    `ref ← α·π + (1 − α)·ref` (TR-DPO's soft update; α = 1, its hard update, is a reset of the
    reference to the policy as ProRL does). The reference's weights are then saved in every checkpoint."""

    sync_every: int = field(default=0, metadata=DEFINES_STATE)
    """Move the reference every N optimizer updates taken (skipped ones do not count; with
    `batching.ppo_minibatches` K a rollout step makes up to K); 0: frozen, the DeepSeekMath setting.
    Needs `policy_loss.kl_beta > 0` and no LoRA (`model.lora.rank=0`): under LoRA the reference is
    the base model with the adapters off, and moving it would mean rewriting the base weights the
    adapters (and their optimizer state, and a sampler holding the base) were built on."""
    mix_alpha: float = 1.0
    """α of the move: the policy's share of the new reference, in (0, 1]. 1.0 (the default) copies
    the policy: a "sync" does what its name says, and a soft update is chosen, not stumbled on.
    TR-DPO's soft updates use α ≈ 0.5–0.6 every step or few steps (TRL's DPO defaults are
    0.6 every 512 steps); with α < 1 the reference trails the policy by about 1/α syncs."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.sync_every, int) and self.sync_every >= 0,
            "reference.sync_every",
            f"must be >= 0 (0: a frozen reference), got {self.sync_every!r}",
        )
        require_finite(self.mix_alpha, "reference.mix_alpha")
        require(
            0 < self.mix_alpha <= 1,
            "reference.mix_alpha",
            f"must be in (0, 1] (1: the reference becomes the policy), got {self.mix_alpha}",
        )

    @property
    def moves(self) -> bool:
        """Whether the reference moves (its weights are then part of a checkpoint)."""
        return self.sync_every > 0
