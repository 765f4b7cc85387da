"""The cookbook's Python API on lit_grpo: a script written against the hosted cookbook runs locally
with its `from training...` imports pointed here.

    from lit_grpo.cookbook import Config, main, DeployConfig, TrainerConfig, WandBConfig
    from lit_grpo.cookbook import RolloutRun, RolloutSample, RolloutSetup, build_deployment_sampler
    from lit_grpo.cookbook import MessageTrajectoryAssembler, TITOTokenizer

| cookbook import | here |
|---|---|
| `training.recipes.async_rl_loop` / `rl_loop`: `Config`, `main`, `RolloutFn`, `RolloutSetup` | `lit_grpo.cookbook` |
| `training.utils`: `DeployConfig`, `TrainerConfig`, `WandBConfig` | `lit_grpo.cookbook` |
| `training.utils`: `InfraConfig`, `WeightSyncConfig` | `lit_grpo.cookbook` |
| `training.utils.rl.rollout`: `RolloutSample`, `RolloutRun` | `lit_grpo.cookbook` |
| `training.utils.rl.rollout`: `MessageTrajectoryAssembler`, `TITOTokenizer` | `lit_grpo.cookbook` |
| `training.examples.rl.vanilla_sampler.build_deployment_sampler` | `lit_grpo.cookbook` |
| `training.utils.rl.PromptGroup` | `lit_grpo.cookbook` |
"""

from lit_grpo.cookbook.config import (
    Config,
    DeployConfig,
    InfraConfig,
    TISConfig,
    TrainerConfig,
    WandBConfig,
    WeightSyncConfig,
)
from lit_grpo.cookbook.messages import (
    MessageTrajectoryAssembler,
    MessageTrajectoryError,
    PrefixMismatch,
    TITOTokenizer,
    TokenTrajectory,
)
from lit_grpo.cookbook.run import (
    DynamicFilterFn,
    RolloutEvaluationFn,
    RolloutFn,
    RolloutFnFactory,
    build_deployment_sampler,
    main,
)
from lit_grpo.rollouts.context import make_evaluation_rollout_fn
from lit_grpo.types import Completion, PromptGroup, RolloutRun, RolloutSample, RolloutSetup

__all__ = [
    "Completion", "Config", "DeployConfig", "DynamicFilterFn", "InfraConfig", "MessageTrajectoryAssembler",
    "MessageTrajectoryError", "PrefixMismatch", "PromptGroup", "RolloutEvaluationFn", "RolloutFn", "RolloutFnFactory",
    "RolloutRun", "RolloutSample", "RolloutSetup", "TISConfig", "TITOTokenizer", "TokenTrajectory", "TrainerConfig",
    "WandBConfig", "WeightSyncConfig", "build_deployment_sampler", "main", "make_evaluation_rollout_fn",
]  # fmt: skip
