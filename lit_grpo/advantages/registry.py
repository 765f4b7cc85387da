"""Advantages: a registry of estimators, each turning one prompt group's rewards into advantages.

An entry is registered by name with its default hyper-parameters (`register_advantage`), in the
module that defines it (the built-ins: `lit_grpo.advantages.estimators` and `.igpo`, imported with
the package); a user's module registers its own and the config names it `module.path:name`
(`advantage.name`), which imports the module first. An entry works at one of three levels:

- per sequence (the default): `fn(rewards_G, **params) -> advantages_G`, `rewards_G` a float64
  tensor of the group's G run rewards. A `RolloutRun`'s segments share their run's reward, so
  they share its advantage too, and G counts runs, not segments;
- per batch (`batch=True`): `fn(rewards_P, **params) -> one tensor per group`, `rewards_P` the
  step's accepted groups on this rank (a list of float64 `[G_p]` tensors): for statistics over
  the whole batch (`batch_std`, `reinforce_pp`). Under DDP the batch is this rank's;
- per token (`per_token=True`): `fn(runs, **params) -> one list per segment` (runs in order, each
  run's segments in order), one value per token of the segment, 0 where nothing is trained. What
  the estimator reads (IGPO: each segment's `turn_spans` and `turn_rewards`) is on the samples.

An entry may register `group_signal(runs, **params) -> bool`: whether a group carries a learning
signal under it even when all its rewards are equal (IGPO: its turns' information gains differ);
without one, a group carries a signal when its reward spread reaches `UNIFORM_TOLERANCE`
(`Advantage.group_signal`, `rewards_uniform`, the one test of a uniform group the package shares).
For scalar rewards: `compute("grpo", rewards_G) -> advantages_G`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lit_grpo.registry import lookup
from lit_grpo.types import RolloutSample

__all__ = [
    "ADVANTAGES",
    "UNIFORM_TOLERANCE",
    "Advantage",
    "AdvantageSpec",
    "advantage_defaults",
    "advantage_param_problems",
    "available_advantages",
    "check_advantage_params",
    "compute",
    "compute_batch",
    "get_advantage",
    "make_advantage",
    "register_advantage",
    "rewards_uniform",
]

Runs = Sequence[Sequence[RolloutSample]]
"""One group's runs, each the `RolloutSample` segments of one rollout call (a lone sample: one segment)."""
ParamCheck = Callable[[Any], Optional[str]]
"""A hyper-parameter's bound: None when the value is fine, else why not."""


def positive(value: Any) -> Optional[str]:
    """A `ParamCheck`: the value is > 0."""
    return None if value > 0 else f"must be > 0, got {value}"


def positive_int(value: Any) -> Optional[str]:
    """A `ParamCheck`: the value is an integer >= 1 (not a bool)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else f"must be an integer >= 1, got {value!r}"


# ---------------------------------------------------------------------------------- a uniform group


UNIFORM_TOLERANCE = 1e-6
"""A group whose reward spread (max - min) is below this is uniform: no learning signal."""


def rewards_uniform(rewards: Iterable[float], tolerance: float = UNIFORM_TOLERANCE) -> bool:
    """True when the spread (max - min) of `rewards` is below `tolerance` (1.0 and 0.99999994, a
    float32 rounding apart, are one reward), so every group-relative advantage of them is zero."""
    values = [float(r) for r in rewards]
    return not values or max(values) - min(values) < tolerance


def uniform_rows(rewards_PG: torch.Tensor, tolerance: float = UNIFORM_TOLERANCE) -> torch.Tensor:
    """[P, G] -> [P, 1]: which groups are uniform (`rewards_uniform`)."""
    spread_P1 = rewards_PG.amax(dim=-1, keepdim=True) - rewards_PG.amin(dim=-1, keepdim=True)
    return spread_P1 < tolerance


# ---------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class AdvantageSpec:
    """A registered advantage estimator."""

    name: str
    fn: Callable[..., Any]
    """Per sequence: `fn(rewards_G, **params) -> [G]`; per token: `fn(runs, **params) -> [segments][tokens]`."""
    defaults: Mapping[str, Any]
    """Every hyper-parameter the estimator takes, with its default."""
    per_token: bool = False
    batch: bool = False
    """`fn(rewards_P, **params)`: the step's groups at once (statistics over the batch)."""
    components: bool = False
    """`fn(rewards_GR, **params)`: R reward components per run (in training, read from each run's
    `metrics` under `Advantage.component_keys`)."""
    group_signal: Optional[Callable[..., bool]] = None
    """`group_signal(runs, **params) -> bool`, or None: the group's rewards differ."""
    checks: Mapping[str, ParamCheck] = field(default_factory=dict)
    """Bounds of some hyper-parameters, checked with the config before anything loads."""
    binary_rewards: bool = False
    """It reads rewards of 0 or 1 only (passk): a config that shapes them is refused before training."""
    needs_turns: bool = False
    """It reads the turns a multi-turn rollout reports (igpo): the single-turn default rollout is refused."""


ADVANTAGES: dict[str, AdvantageSpec] = {}


def register_advantage(
    name: str,
    *,
    per_token: bool = False,
    batch: bool = False,
    components: bool = False,
    group_signal: Optional[Callable[..., bool]] = None,
    checks: Optional[Mapping[str, ParamCheck]] = None,
    binary_rewards: bool = False,
    needs_turns: bool = False,
    **defaults: Any,
) -> Callable:
    """Decorator registering an advantage estimator under `name` with its default hyper-parameters
    (each a keyword argument of the function: checked now, so a typo fails at import)."""
    if name in ADVANTAGES:
        raise ValueError(f"advantage {name!r} is already registered")
    if per_token + batch + components > 1:
        raise ValueError(f"advantage {name!r}: per_token, batch and components exclude each other")
    if unknown := sorted(set(checks or {}) - set(defaults)):
        raise ValueError(f"advantage {name!r}: checks of {', '.join(unknown)}, which it has no default for")

    def decorator(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if not takes_any and (missing := sorted(set(defaults) - set(params))):
            raise TypeError(f"advantage {name!r}: {fn.__name__} must accept keyword(s) {', '.join(missing)}")
        ADVANTAGES[name] = AdvantageSpec(
            name, fn, dict(defaults), per_token, batch, components, group_signal, dict(checks or {}),
            binary_rewards=binary_rewards, needs_turns=needs_turns,
        )  # fmt: skip
        return fn

    return decorator


def available_advantages() -> list[str]:
    """Names of the registered advantage estimators, sorted."""
    return sorted(ADVANTAGES)


def get_advantage(name: str) -> AdvantageSpec:
    """The registered estimator `name` (or `module.path:name`, importing the module first); a
    ValueError listing the valid names otherwise."""
    return lookup(name, ADVANTAGES, "advantage")


def advantage_defaults(name: str) -> dict[str, Any]:
    """Every hyper-parameter of estimator `name` with its registered default (a fresh dict)."""
    return dict(get_advantage(name).defaults)


def advantage_param_problems(name: str, params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(hyper-parameter, why) for each of `params` the estimator does not take, whose type differs
    from its default's (an int is a fine float), or that is out of the entry's bounds."""
    spec = get_advantage(name)
    problems = []
    for key, value in params.items():
        if key not in spec.defaults:
            problems.append((key, f"not taken; valid hyper-parameters: {', '.join(sorted(spec.defaults)) or 'none'}"))
            continue
        default = spec.defaults[key]
        if isinstance(default, bool) and not isinstance(value, bool):
            problems.append((key, f"must be true or false, got {value!r}"))
        elif isinstance(default, float) and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            problems.append((key, f"must be a finite number, got {value!r}"))
        elif key in spec.checks and (why := spec.checks[key](value)):
            problems.append((key, why))
    return problems


def check_advantage_params(name: str, params: Mapping[str, Any]) -> None:
    """Raise ValueError if `name` is unknown or a hyper-parameter in `params` is not accepted."""
    if problems := advantage_param_problems(name, params):
        raise ValueError(f"advantage {name!r}: " + "; ".join(f"{key}: {why}" for key, why in problems))


@dataclass(frozen=True)
class Advantage:
    """A registered estimator with its hyper-parameters: what the rollout pipeline calls."""

    spec: AdvantageSpec
    params: Mapping[str, Any]
    """Every hyper-parameter, defaults filled in."""
    component_keys: tuple[str, ...] = ()
    """For a `components` entry: the `metrics` keys of the reward's components, in order (a weighted
    `reward.fn` list puts each component's value there as `reward/<name>`); empty: one component,
    the run's reward."""

    def rewards_of(self, runs: Runs) -> list:
        """What the estimator reads of one group: each run's reward, or (a `components` entry) each
        run's [R] reward components; a component a run's reward skipped (None: not applicable) is
        0, as it is in the weighted sum."""
        if not self.spec.components:
            return [float(run[0].reward) for run in runs]
        if not self.component_keys:
            return [[float(run[0].reward)] for run in runs]
        return [[float(run[0].metrics.get(key, 0.0)) for key in self.component_keys] for run in runs]

    @property
    def per_token(self) -> bool:
        return self.spec.per_token

    def run_advantages(self, rewards: Sequence) -> list[float]:
        """A per-sequence estimator's advantages of one group's run rewards (a per-batch one's: the
        group is the batch; a `components` one's: [G, R]). Shape: [G] -> [G]."""
        return self.batch_advantages([rewards])[0]

    def batch_advantages(self, rewards_P: Sequence[Sequence]) -> list[list[float]]:
        """The advantages of the step's groups (this rank's), one list per group: a per-batch
        estimator sees them all at once, a per-sequence one each group alone."""
        tensors = [torch.tensor(rewards, dtype=torch.float64) for rewards in rewards_P]
        outs = (
            self.spec.fn(tensors, **self.params)
            if self.spec.batch
            else [self.spec.fn(t, **self.params) for t in tensors]
        )
        if len(outs) != len(tensors):
            raise ValueError(f"advantage {self.spec.name!r} returned {len(outs)} groups for {len(tensors)}")
        result = []
        for rewards, out in zip(tensors, outs):
            out = torch.as_tensor(out).to(torch.float32)
            if tuple(out.shape) != (len(rewards),):
                raise ValueError(
                    f"advantage {self.spec.name!r} returned shape {tuple(out.shape)} for {len(rewards)} rewards"
                )
            result.append(out.tolist())
        return result

    def token_advantages(self, runs: Runs) -> list[list[float]]:
        """A per-token estimator's advantages of one group: per segment (runs in order), per token."""
        out = [list(map(float, values)) for values in self.spec.fn(runs, **self.params)]
        if [len(v) for v in out] != [len(s.tokens) for run in runs for s in run]:
            raise ValueError(f"advantage {self.spec.name!r} must return one list per segment, one value per token")
        return out

    @property
    def has_own_signal(self) -> bool:
        """Whether the entry registered its own `group_signal` (else: the group's rewards differ)."""
        return self.spec.group_signal is not None

    def group_signal(self, runs: Runs, tolerance: float = UNIFORM_TOLERANCE) -> bool:
        """Whether the group carries a learning signal under this estimator (the reward filter's
        test): the entry's own `group_signal`, else a reward spread of at least `tolerance`."""
        if self.spec.group_signal is not None:
            return bool(self.spec.group_signal(runs, **self.params))
        return not rewards_uniform((run[0].reward for run in runs), tolerance)


def make_advantage(
    name: str = "grpo", params: Optional[Mapping[str, Any]] = None, component_keys: Sequence[str] = ()
) -> Advantage:
    """Estimator `name` with `params` over its defaults (`component_keys`: `Advantage.component_keys`);
    ValueError on an unknown name or hyper-parameter."""
    spec = get_advantage(name)
    check_advantage_params(name, params or {})
    return Advantage(spec, {**spec.defaults, **(params or {})}, tuple(component_keys))


def _not_per_token(advantage: Advantage) -> Advantage:
    if advantage.per_token:
        name = advantage.spec.name
        raise ValueError(f"advantage {name!r} is per token: it needs the group's samples (Advantage.token_advantages)")
    return advantage


def compute(name: str, rewards_G: torch.Tensor | Sequence, **params: Any) -> torch.Tensor:
    """The advantages of one group of G scalar rewards (`gdpo`: [G, R] reward components); a
    per-batch estimator takes the group as its whole batch. Shape: [G] -> [G], float32."""
    advantage = _not_per_token(make_advantage(name, params))
    rewards = rewards_G.tolist() if isinstance(rewards_G, torch.Tensor) else list(rewards_G)
    return torch.tensor(advantage.run_advantages(rewards), dtype=torch.float32)


def compute_batch(name: str, rewards_PG: Sequence[Sequence[float]], **params: Any) -> list[torch.Tensor]:
    """The advantages of a step's P groups (sizes may differ), as training computes them: a
    per-batch estimator (`batch_std`, `reinforce_pp`) sees them all. [P][G_p] -> P tensors [G_p]."""
    advantage = _not_per_token(make_advantage(name, params))
    rewards = [g.tolist() if isinstance(g, torch.Tensor) else list(g) for g in rewards_PG]
    return [torch.tensor(a, dtype=torch.float32) for a in advantage.batch_advantages(rewards)]
