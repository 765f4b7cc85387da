"""A composed config checked whole, before anything loads: the schema and each group's bounds
(`lit_grpo.config.parse`), then every check that needs a registry: the sampler kind, the reward
functions, the policy loss and its hyper-parameters, the advantage estimator and its
hyper-parameters (and whether it can read the rewards and samples the rollout gives it), the
mismatch correction and its parameters, and the task's options.

It sits above the registries (samplers, rewards, losses, tasks), so the config's dataclasses
import nothing above them. Raises `ConfigError` naming the field.
"""

from __future__ import annotations

from omegaconf import DictConfig

from lit_grpo.advantages.registry import advantage_param_problems, get_advantage
from lit_grpo.config import (
    AdvantageConfig,
    ConfigError,
    CorrectionConfig,
    PolicyLossConfig,
    RewardConfig,
    RolloutConfig,
    SamplerConfig,
    TrainConfig,
    parse,
    require,
)
from lit_grpo.config.controls import CORRECTION_PARAMS
from lit_grpo.maths.correction import correction_param_problems, get_correction
from lit_grpo.maths.loss_params import policy_loss_param_problems
from lit_grpo.maths.losses import LOSS_NORMALIZATIONS
from lit_grpo.rewards.combine import RESERVED_NAMES, check_weights, component_names
from lit_grpo.samplers import available_samplers
from lit_grpo.tasks import check_task


def validate(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """`cfg` as a `TrainConfig` that passed every check; raises `ConfigError` naming the field."""
    c = parse(cfg)
    check_sampler(c.sampler)
    check_reward(c.reward)
    check_policy_loss(c.policy_loss)
    check_advantage(c.advantage)
    check_components(c.advantage, c.reward)
    check_advantage_inputs(c)
    check_correction(c.correction)
    check_task(c)
    if c.curriculum.fn is not None:
        from lit_grpo.rollouts.curriculum import weight_fn  # here: the rollouts package imports transformers

        weight_fn(c.curriculum.fn)  # imports the user's module: a missing one is named before any model loads
    return c


def check_sampler(s: SamplerConfig) -> None:
    require(
        s.kind in available_samplers(),
        "sampler.kind",
        f"unknown sampler {s.kind!r}; valid: {', '.join(available_samplers())}",
    )


def check_reward(r: RewardConfig) -> None:
    specs = r.specs()
    names = component_names(specs)  # imports a user's module: a missing one is named here
    if len(names) > 1:
        require(
            len(set(names)) == len(names),
            "reward.fn",
            f"two components share a name ({', '.join(names)}): their "
            "reward/<name> curves would mix; give the functions distinct names",
        )
        for name in names:
            require(
                name not in RESERVED_NAMES,
                "reward.fn",
                f"a component may not be called {name!r}: reward/{name} is already logged",
            )
    if why := check_weights(r.weights, max(len(specs), 1)):
        require(False, "reward.weights", why)


def check_components(a: AdvantageConfig, r: RewardConfig) -> None:
    """An estimator of reward components (gdpo) given its own weights has one per component of `reward.fn`."""
    weights = a.params.get("weights")
    if get_advantage(a.name).components and weights is not None:
        count = len(component_names(r.specs()))
        require(
            count > 1,
            "advantage.params.weights",
            f"weighs reward components, and the reward has one (reward.fn is {r.fn!r}): leave it null",
        )
        if why := check_weights(list(weights), count):
            require(False, "advantage.params.weights", why)


def check_advantage_inputs(c: TrainConfig) -> None:
    """The estimator can read what the run's rollout and reward give it: a combination that would
    fail at the first step, or drop a reward term silently, is refused naming both fields."""
    spec, chosen = get_advantage(c.advantage.name), f"advantage.name={c.advantage.name}"
    penalty = c.rollout.overlong_buffer_len > 0 and c.rollout.overlong_penalty_factor > 0
    if spec.binary_rewards:
        needs = f"{chosen} reads rewards of 0 or 1 only; choose another advantage or"
        require(
            not penalty, "rollout.overlong_buffer_len", f"the overlong penalty shapes rewards, and {needs} set it to 0"
        )
        require(
            c.reward.timeout_reward in (0, 1),
            "reward.timeout_reward",
            f"a timed-out reward scores {c.reward.timeout_reward}, and {needs} make it 0 or 1",
        )
        for weight in c.reward.weights or []:
            require(weight in (0, 1), "reward.weights", f"a weight of {weight} scales rewards, and {needs} use 0 or 1")
    components = component_names(c.reward.specs()) if spec.components else []
    require(
        not (penalty and len(components) > 1),
        "rollout.overlong_buffer_len",
        f"the overlong penalty is added to the summed reward, and {chosen} reads reward.fn's components "
        f"({', '.join(components)}), never the penalty; choose another advantage or set it to 0",
    )
    require(
        not spec.needs_turns or c.rollout.factory != RolloutConfig().factory,
        "rollout.factory",
        f"the default samples one turn and reports none, and {chosen} credits the turns a multi-turn rollout "
        "reports (Trajectory.to_sample(turn_rewards=...)); name such a rollout, e.g. +experiment=igpo_lookup",
    )


def check_advantage(a: AdvantageConfig) -> None:
    """The estimator is registered and takes every hyper-parameter in `params`, within its bounds."""
    try:
        get_advantage(a.name)  # imports a user's module: a missing one is named here
    except ValueError as err:
        raise ConfigError(f"config field `advantage.name`: {err}") from None
    for key, why in advantage_param_problems(a.name, a.params):
        require(False, f"advantage.params.{key}", f"advantage {a.name!r}: {why}")


def check_correction(c: CorrectionConfig) -> None:
    """The mode is registered and takes every parameter that is set, within its bounds."""
    try:
        defaults = get_correction(c.name).defaults  # imports a user's module: a missing one is named here
    except ValueError as err:
        raise ConfigError(f"config field `correction.name`: {err}") from None
    for key, why in correction_param_problems(c.name, c.params()):
        takes = ", ".join(k for k in CORRECTION_PARAMS if k in defaults) or "no parameter"
        require(False, f"correction.{key}", f"{why} (correction={c.name} takes {takes})")


def check_policy_loss(p: PolicyLossConfig) -> None:
    """The variant is registered and takes every hyper-parameter in `params`, within its bounds."""
    require(
        p.loss_normalization in LOSS_NORMALIZATIONS,
        "policy_loss.loss_normalization",
        f"must be one of {', '.join(LOSS_NORMALIZATIONS)}, got {p.loss_normalization!r}",
    )
    try:
        problems = policy_loss_param_problems(p.name, p.params)  # imports a user's module: a missing one is named here
    except ValueError as err:
        raise ConfigError(f"config field `policy_loss.name`: {err}") from None
    for key, why in problems:
        require(False, f"policy_loss.params.{key}", f"policy loss {p.name!r}: {why}")
