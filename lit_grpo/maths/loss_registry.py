"""The policy-loss registry: each variant registered by name, with its default hyper-parameters,
in the module that defines it (`ppo_losses`, `trust_region_losses`, or a user's module).

A variant is a function of keyword-only `[B, T]` tensors returning `(loss_BT, metrics)`
(`PolicyLossSpec.fn`); `lit_grpo.maths.losses` imports the built-in families, so importing it
fills this registry, and runs the variants with what they share (`per_token_policy_loss`). Every
function taking a loss `name` also accepts `module.path:name`, which imports `module.path` (the
module that registers the loss) first, so a user's loss is usable from the config alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo.registry import lookup

PolicyLossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]

_SHARED_TENSORS = ("logprobs", "old_logprobs", "advantages", "mask")
# Tensors a variant gets only if its signature names them (the sampler's logprobs, for a loss
# whose ratio is to the behaviour policy itself), and that no hyper-parameter may be called.
_OPTIONAL_TENSORS = ("sampler_logprobs",)
_TENSOR_NAMES = (*_SHARED_TENSORS, "tis_weight", *_OPTIONAL_TENSORS)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss."""

    name: str
    fn: PolicyLossFn
    """The variant: keyword-only `logprobs, old_logprobs, advantages, mask` (all `[B, T]`, the
    advantages already broadcast), `tis_weight` `[B, T]` if `uses_tis`, `sampler_logprobs`
    (`[B, T]`, detached, 0 on masked-out tokens; or None) if `takes_sampler_logprobs`, and its own
    hyper-parameters; returns the per-token loss `[B, T]` and a dict of metric tensors."""
    defaults: Mapping[str, Any]
    """Every hyper-parameter the variant takes, with its default; always includes `kl_beta`."""
    uses_tis: bool
    """Whether the loss is multiplied by the mismatch correction's weights (`tis_weight`, from
    `lit_grpo.maths.correction`); a loss without (its ratio is to the sampler already) still has
    the tokens the correction drops taken out."""
    takes_sampler_logprobs: bool = False
    """Whether the function's signature names `sampler_logprobs` (then it receives them)."""
    vanishes_without_advantage: bool = False
    """Whether a token of advantage 0 has loss 0 whatever the logprobs (the term is the advantage
    times something finite), so a sequence of advantage 0 has no gradient: the trainer may leave it
    out of the training forward (`batching.skip_zero_advantage_rows`). False for a loss with any
    other term (dro's squared log-ratio), and for a user's loss unless it says so."""


POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_policy_loss(
    name: str, *, uses_tis: bool = True, vanishes_without_advantage: bool = False, **default_hyperparams: Any
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` with its default hyper-parameters.

    `kl_beta` defaults to 0.0 unless given here. Every other default names a keyword argument of
    the function, checked now so that a typo fails at import rather than at the first training
    step. With `uses_tis` the function takes `tis_weight`, the correction's per-token weight. A
    function whose signature names `sampler_logprobs` (explicitly, not through `**kwargs`)
    receives the sampler's logprobs, with or without `uses_tis`. `vanishes_without_advantage`:
    `PolicyLossSpec.vanishes_without_advantage` (`tests/test_losses.py` checks every built-in's).
    """
    if name in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is already registered")
    if clash := sorted(set(_TENSOR_NAMES) & set(default_hyperparams)):
        raise ValueError(f"policy loss {name!r}: {', '.join(clash)} is an input tensor, not a hyper-parameter")
    defaults = {"kl_beta": 0.0, **default_hyperparams}

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        own = set(defaults) - {"kl_beta"}
        wanted = {*_SHARED_TENSORS, *own, *(["tis_weight"] if uses_tis else [])}
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            missing = sorted(wanted - set(params))
            if missing:
                raise TypeError(f"policy loss {name!r}: {fn.__name__} must accept keyword(s) {', '.join(missing)}")
        takes_sampler = "sampler_logprobs" in params and params["sampler_logprobs"].kind in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
        POLICY_LOSSES[name] = PolicyLossSpec(
            name=name, fn=fn, defaults=defaults, uses_tis=uses_tis, takes_sampler_logprobs=takes_sampler,
            vanishes_without_advantage=vanishes_without_advantage,
        )  # fmt: skip
        return fn

    return decorator


def available_policy_losses() -> list[str]:
    """Names of the registered policy losses, sorted."""
    return sorted(POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLossSpec:
    """The registered loss `name` (or `module.path:name`, importing the module first); a
    ValueError listing the valid names otherwise."""
    return lookup(name, POLICY_LOSSES, "policy loss")


def policy_loss_defaults(name: str) -> dict[str, Any]:
    """Every hyper-parameter of loss `name` with its registered default (a fresh dict)."""
    return dict(get_policy_loss(name).defaults)


def check_policy_loss_hyperparams(name: str, params: Mapping[str, Any]) -> None:
    """Raise ValueError if `name` is unknown, `params` has a key the loss does not take, or
    `kl_beta` is negative.

    Cheap and tensor-free, so config validation calls it before any model loads.
    """
    defaults = get_policy_loss(name).defaults
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        moved = " (the mismatch correction is its own group: correction=tis correction.cap=... correction.level=...)"
        raise ValueError(
            f"policy loss {name!r} does not take {', '.join(unknown)}; "
            f"valid hyper-parameters: {', '.join(sorted(defaults))}"
            + (moved if {"tis_cap", "tis_level"} & set(unknown) else "")
        )
    if "kl_beta" in params and not params["kl_beta"] >= 0:
        raise ValueError(f"policy loss {name!r}: kl_beta must be >= 0, got {params['kl_beta']}")
