"""`main(cfg, rollout_fn_factory=..., rows=...)`: the cookbook's entry point, running the same
training as `python -m lit_grpo.train` (the config is translated, then validated and trained by
`lit_grpo.train.train`)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from lit_grpo.config import ConfigError, UserInputs
from lit_grpo.cookbook.config import Config, to_hydra_config
from lit_grpo.loop.signals import StopRequested, quiet_abandoned_work
from lit_grpo.types import PromptGroup, RolloutSetup

log = logging.getLogger(__name__)

RolloutFn = Callable[..., Awaitable[Any]]
"""`async rollout_fn(row, **context) -> RolloutSample | RolloutRun | None`."""
RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]
DynamicFilterFn = Callable[[PromptGroup], bool]
RolloutEvaluationFn = Callable[[int, RolloutFn], Awaitable[Optional[dict]]]


def build_deployment_sampler(setup: RolloutSetup) -> Any:
    """The sampler a rollout should call: lit_grpo's in-process one, handed over in `setup.sampler`
    (the cookbook builds a client of a hosted deployment here)."""
    if setup.sampler is None:
        raise RuntimeError(
            "setup.sampler is None: lit_grpo builds the sampler from the config (sampler=hf or vllm) "
            "and hands it over in RolloutSetup; there is no hosted deployment to connect to"
        )
    return setup.sampler


def main(
    config: Config,
    *,
    rollout_fn_factory: Optional[RolloutFnFactory] = None,
    dynamic_filter_fn: Optional[DynamicFilterFn] = None,
    evaluation_fn: Optional[RolloutEvaluationFn] = None,
    evaluation_interval: int = 1,
    rows: Optional[list[dict]] = None,
    rollout_extras: Optional[dict[str, Any]] = None,
    reward_fn: Optional[Callable[[str, dict], Optional[float]]] = None,
) -> dict[str, Any]:
    """Train as the config says; returns the run summary (`steps`, first/final reward, ...).

    `rows` (or `config.dataset`) are the training rows, handed to the rollout function exactly
    as given; `rollout_fn_factory(setup)` makes the rollout function (default: lit_grpo's, which
    samples the row's `prompt_token_ids` / `messages` / `prompt` and scores it with `reward_fn`,
    or `config.reward`); `dynamic_filter_fn(group)` keeps a group when True; `evaluation_fn(step,
    eval_rollout_fn)` is awaited every `evaluation_interval` steps and its metrics logged.

    A bad config raises `ConfigError` naming the field before any model is loaded. SIGINT or
    SIGTERM end the run after a checkpoint (when checkpoints are on) and exit with 128 + signal.
    """
    from lit_grpo.train import train

    if rows is None and not config.dataset:
        raise ConfigError("main() needs rows: pass rows=[...] or set Config.dataset to a file or dataset")
    if rollout_fn_factory is None and reward_fn is None and not config.reward:
        raise ConfigError(
            "nothing scores the samples: pass rollout_fn_factory= (its rollouts set the reward), "
            "reward_fn=, or Config.reward (a registered reward such as 'gsm8k', or 'module:function')"
        )
    if evaluation_interval < 1:
        raise ConfigError(f"evaluation_interval must be >= 1, got {evaluation_interval}")
    inputs = UserInputs(
        rows=rows,
        rollout_factory=rollout_fn_factory,
        rollout_extras=dict(rollout_extras or {}),
        reward_fn=reward_fn,
        group_filter=dynamic_filter_fn,
        evaluation_fn=evaluation_fn,
        evaluation_interval=evaluation_interval,
    )
    try:
        return train(to_hydra_config(config), inputs)
    except StopRequested as stop:  # as the CLI does: non-zero, so that a preempting scheduler requeues the job
        quiet_abandoned_work()
        print(stop.report(), file=sys.stderr)
        sys.exit(128 + stop.signum)
