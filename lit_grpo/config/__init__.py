"""Configuration: one documented dataclass per Hydra group and `TrainConfig` over them.

    checks.py       ConfigError, `require`, the bounds every group shares
    model.py        ModelConfig, LoraConfig: the policy and its adapters
    sampler.py      SamplerConfig: the engine, how it samples, the vLLM servers' fields
    groups.py       data, rollout, reward, advantage, policy loss
    curriculum.py   CurriculumConfig: which rows are drawn, by their online pass rate
    training.py     optim, batching, checkpoint: the trainer's side of a step
    offpolicy.py    OffPolicyConfig: how sampling overlaps training, weight syncs, partial rollouts
    guards.py       GuardsConfig: rollout deadlines and retries, the bounds that stop a broken run
    trainer.py      LightningTrainerConfig: the Lightning Trainer's arguments
    controls.py     what applies around every loss: the mismatch correction, the entropy controls,
                    the KL reference's schedule
    run.py          TrainConfig (the whole run), `parse` (a composed DictConfig into it), the ConfigStore node
    moved.py        MOVED: old key names, working for one release, and the renaming
    knobs.py        `ineffective_knobs`: values a config sets that have no effect in it
    keys.py         keys the schema does not have (a misspelt key, with the one meant)
    sources.py      a data file's kind; a model or dataset that cannot be reached from here
    user_inputs.py  what a Python caller hands a run beside its config (rows, functions)

The dataclasses check their fields' bounds and types in `__post_init__`; the rules between a group
and the rest of the run are one `check_<group>(c)` each; every check that needs a registry
(losses, samplers, rewards, tasks) runs in `lit_grpo.run.validate`.
"""

from lit_grpo.config.checks import (
    DEFINES_STATE,
    MAX_LEARNING_RATE,
    MAX_TEMPERATURE,
    ConfigError,
    require,
    require_finite,
)
from lit_grpo.config.controls import CorrectionConfig, EntropyConfig, ReferenceConfig
from lit_grpo.config.curriculum import CurriculumConfig
from lit_grpo.config.groups import (
    AdvantageConfig,
    DataConfig,
    PolicyLossConfig,
    RewardConfig,
    RolloutConfig,
)
from lit_grpo.config.guards import GuardsConfig
from lit_grpo.config.knobs import ineffective_knobs
from lit_grpo.config.model import LORA_DEFAULT_TARGETS, LoraConfig, ModelConfig
from lit_grpo.config.moved import MOVED
from lit_grpo.config.offpolicy import OffPolicyConfig
from lit_grpo.config.run import TrainConfig, parse
from lit_grpo.config.sampler import SamplerConfig
from lit_grpo.config.trainer import LightningTrainerConfig
from lit_grpo.config.training import BatchingConfig, CheckpointConfig, OptimConfig
from lit_grpo.config.user_inputs import UserInputs

__all__ = [
    "AdvantageConfig",
    "BatchingConfig",
    "CheckpointConfig",
    "DEFINES_STATE",
    "LORA_DEFAULT_TARGETS",
    "MAX_LEARNING_RATE",
    "MAX_TEMPERATURE",
    "ConfigError",
    "CorrectionConfig",
    "CurriculumConfig",
    "DataConfig",
    "EntropyConfig",
    "GuardsConfig",
    "LightningTrainerConfig",
    "LoraConfig",
    "MOVED",
    "ModelConfig",
    "OffPolicyConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplerConfig",
    "TrainConfig",
    "UserInputs",
    "ineffective_knobs",
    "require",
    "parse",
    "require_finite",
]
