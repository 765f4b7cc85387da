"""The cookbook's `Config` and its sub-configs, under the cookbook's names, and their translation
to lit_grpo's `TrainConfig` (the same composed Hydra config the CLI runs).

Fields that only make sense for a hosted service (training shapes, deployment ids, regions,
hot-load buckets, router replay) are accepted so a cookbook script runs unchanged, and named in
one warning when they are set; fields lit_grpo cannot honour yet are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from lit_grpo.config import ConfigError
from lit_grpo.config.moved import rename_overrides

log = logging.getLogger(__name__)

TINY_MODEL = "tiny"
"""`base_model="tiny"`: lit_grpo's random-init 2-layer model with a character tokenizer (no download)."""


@dataclass
class TrainerConfig:
    """The cookbook's policy-trainer settings: all hosted-service provisioning, ignored here."""

    job_id: Optional[str] = None
    training_shape_id: Optional[str] = None
    reference_training_shape_id: Optional[str] = None
    reference_job_id: Optional[str] = None
    region: Optional[str] = None
    node_count: Optional[int] = None
    replica_count: Optional[int] = None
    custom_image_tag: Optional[str] = None
    extra_args: Optional[list] = None


@dataclass
class InfraConfig:
    """The cookbook's `rl_loop` provisioning settings: hosted-service only, ignored here."""

    training_shape_id: Optional[str] = None
    ref_training_shape_id: Optional[str] = None
    region: Optional[str] = None


@dataclass
class DeployConfig:
    """The cookbook's inference deployment. Only `tokenizer_model` means something here: it must
    name the policy's own tokenizer (lit_grpo samples with the policy, in process)."""

    tokenizer_model: Optional[str] = None
    deployment_id: Optional[str] = None
    deployment_shape: Optional[str] = None
    deployment_accelerator_type: Optional[str] = None
    replica_count: Optional[int] = None
    max_batch_size: Optional[int] = None
    hot_load_bucket_type: Optional[str] = None
    deployment_extra_args: Optional[list] = None


@dataclass
class WeightSyncConfig:
    """The cookbook's weight-sync settings (`rl_loop`)."""

    weight_sync_interval: int = 1
    dcp_save_interval: int = 0


@dataclass
class WandBConfig:
    """Weights & Biases run naming; a set `entity` turns the W&B logger on (offline without WANDB_API_KEY)."""

    entity: Optional[str] = None
    project: Optional[str] = None
    run_name: Optional[str] = None


@dataclass
class TISConfig:
    """Truncated importance sampling against the sampler's logprobs."""

    cap: float = 5.0
    level: str = "token"


@dataclass
class Config:
    """The cookbook's RL recipe config (`async_rl_loop` and `rl_loop` share these names).

    lit_grpo additions: `reward` (a registered reward or `module:function`, when neither a rollout
    factory nor `main(reward_fn=...)` scores the samples) and `overrides` (Hydra overrides applied
    last, e.g. `["sampler=vllm", "trainer.fast_dev_run=true"]`).
    """

    log_path: str
    base_model: str = TINY_MODEL
    dataset: Optional[str] = None
    learning_rate: float = 1e-5
    kl_beta: float = 0.001
    completions_per_prompt: int = 4
    max_completion_tokens: int = 1024
    temperature: float = 1.0
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    max_rows: int = 100
    max_seq_len: Optional[int] = None
    lora_rank: int = 0  # model.lora.rank (0: full fine-tuning)
    prompt_groups_per_step: int = 1
    max_head_offpolicy_versions: int = 0
    max_concurrency_rollout_sample: Optional[int] = None
    min_group_size: int = 1
    grad_clip_norm: float = 0.0
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    tis: TISConfig = field(default_factory=TISConfig)
    policy_loss: str = "grpo"
    weight_sync_interval: int = 1
    synchronous_training: bool = False
    dcp_save_interval: int = 0
    init_from_checkpoint: Optional[str] = None
    output_model_id: Optional[str] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    infra: InfraConfig = field(default_factory=InfraConfig)
    deployment: DeployConfig = field(default_factory=DeployConfig)
    weight_sync: Optional[WeightSyncConfig] = None
    wandb: WandBConfig = field(default_factory=WandBConfig)
    lora_alpha: Optional[int] = 32  # with lora_rank > 0: model.lora.alpha (None: 2·lora_rank)
    # Hosted-service or not-applicable knobs, accepted and ignored (named in one warning when set).
    renderer_name: str = ""
    router_replay: bool = True
    router_replay_completion_only: bool = True
    grad_accumulation_normalization: Optional[str] = None
    pipeline_chunks_per_step: int = 1
    max_incomplete_group_retries: int = 0
    anchor_logp: str = "old_policy"
    weight_sync_timeout: int = 600
    cleanup_on_exit: bool = True
    save_final_checkpoint: bool = True
    warm_start_from_adapter: Optional[str] = None
    # lit_grpo's own.
    reward: Optional[str] = None
    overrides: list = field(default_factory=list)


IGNORED_FIELDS = (
    "renderer_name", "router_replay", "router_replay_completion_only", "grad_accumulation_normalization",
    "pipeline_chunks_per_step", "max_incomplete_group_retries", "weight_sync_timeout", "cleanup_on_exit",
    "save_final_checkpoint", "trainer", "infra",
)  # fmt: skip
_DEPLOYMENT_IGNORED = tuple(f.name for f in dataclasses.fields(DeployConfig) if f.name != "tokenizer_model")


def ignored_settings(cfg: Config) -> list[str]:
    """The hosted-only fields `cfg` sets to something other than their default (dotted names)."""
    defaults = Config(log_path=cfg.log_path)
    names = []
    for name in IGNORED_FIELDS:
        value, default = getattr(cfg, name), getattr(defaults, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names += [
                f"{name}.{k}" for k, v in dataclasses.asdict(value).items() if v != dataclasses.asdict(default)[k]
            ]
        elif value != default:
            names.append(name)
    names += [f"deployment.{k}" for k in _DEPLOYMENT_IGNORED if getattr(cfg.deployment, k) is not None]
    return names


def _model_overrides(cfg: Config) -> tuple[list[str], dict[str, Any]]:
    if cfg.base_model == TINY_MODEL:
        return ["model=tiny"], {}
    tokenizer = cfg.deployment.tokenizer_model
    if tokenizer and tokenizer != cfg.base_model:
        log.warning(
            "deployment.tokenizer_model=%r differs from base_model=%r: lit_grpo samples with the policy "
            "itself, so the tokenizer is base_model's",
            tokenizer,
            cfg.base_model,
        )
    return ["model=hf"], {"model.name_or_path": cfg.base_model, "model.dtype": "float32"}


FALLBACK_CONTEXT_LENGTH = 4096
"""`max_seq_len=None` with a model whose config cannot be read here (the preflight reports why)."""


def context_length(base_model: str, composed: DictConfig) -> int:
    """The cookbook's `max_seq_len=None`: the model's own context length."""
    if base_model == TINY_MODEL:
        return int(composed.model.max_position_embeddings)
    try:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(base_model)
    except (OSError, ValueError):
        return FALLBACK_CONTEXT_LENGTH
    return int(getattr(model_config, "max_position_embeddings", None) or FALLBACK_CONTEXT_LENGTH)


def to_hydra_config(cfg: Config) -> DictConfig:
    """The composed run config for `cfg`: the CLI's defaults with the cookbook's values set.

    Refuses (ConfigError naming the field) what lit_grpo cannot do; warns once about hosted-only
    fields that are set. The result still goes through `lit_grpo.run.validate.validate`.
    """
    from lit_grpo.train import compose_config

    if not isinstance(cfg, Config):
        raise ConfigError(f"main() takes a lit_grpo.cookbook.Config, got {type(cfg).__name__}")
    if cfg.warm_start_from_adapter:
        raise ConfigError(
            "config field `warm_start_from_adapter`: starting from a saved adapter is not supported; "
            "set lora_rank for fresh adapters, or merge the adapter into base_model first"
        )
    if ignored := ignored_settings(cfg):
        log.warning("hosted-service settings have no meaning for a local run and are ignored: %s", ", ".join(ignored))
    sync = cfg.weight_sync or WeightSyncConfig(cfg.weight_sync_interval, cfg.dcp_save_interval)
    groups, values = _model_overrides(cfg)
    from lit_grpo.train import CONF_DIR

    # A built-in variant has its defaults in conf/policy_loss/; any other name (a user's `module:name`,
    # or a typo the validation names) goes through the `user` group.
    builtin = (CONF_DIR / "policy_loss" / f"{cfg.policy_loss}.yaml").is_file() and cfg.policy_loss != "user"
    groups.append(f"policy_loss={cfg.policy_loss}" if builtin else "policy_loss=user")
    use_wandb = bool(cfg.wandb.entity)  # as the cookbook: W&B only with an entity
    groups.append("logger=[csv,wandb]" if use_wandb else "logger=csv")
    overrides = rename_overrides([str(o) for o in cfg.overrides])  # old key names: renamed here, said once
    composed = compose_config(groups + overrides)  # the user's overrides win over the fields below
    overridden = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    values.update(
        {
            "output_dir": cfg.log_path,
            "seed": cfg.seed,
            "learning_rate": cfg.learning_rate,
            "optim.grad_clip_norm": cfg.grad_clip_norm,
            "offpolicy.weight_sync_interval": sync.weight_sync_interval,
            "checkpoint.save_interval": sync.dcp_save_interval,
            "offpolicy.synchronous": cfg.synchronous_training,
            "offpolicy.max_lag": cfg.max_head_offpolicy_versions,
            "output_model_id": cfg.output_model_id or "final_model",
            "resume": cfg.init_from_checkpoint,
            "data.completions_per_prompt": cfg.completions_per_prompt,
            "data.prompt_groups_per_step": cfg.prompt_groups_per_step,
            "data.epochs": cfg.epochs,
            "data.shuffle": cfg.shuffle,
            "data.max_rows": cfg.max_rows,
            # lit_grpo needs two samples for a group-relative advantage; the cookbook's 1 keeps lone samples
            # (advantage 0).
            "data.min_group_size": max(2, min(cfg.min_group_size, cfg.completions_per_prompt)),
            "sampler.max_completion_tokens": cfg.max_completion_tokens,
            "sampler.temperature": cfg.temperature,
            "policy_loss.kl_beta": cfg.kl_beta,
            "policy_loss.anchor_logp": cfg.anchor_logp,
        }
    )
    if not builtin:
        values["policy_loss.name"] = cfg.policy_loss
    values["data.max_seq_len"] = cfg.max_seq_len or context_length(cfg.base_model, composed)
    if cfg.lora_rank:  # only then: an unchanged model.lora keeps older checkpoints resumable
        values["model.lora.rank"] = cfg.lora_rank
        values["model.lora.alpha"] = cfg.lora_alpha
    if cfg.max_concurrency_rollout_sample is not None:
        values["rollout.max_concurrency"] = cfg.max_concurrency_rollout_sample
    if cfg.dataset:
        values["data.path"] = cfg.dataset
    if cfg.reward:
        values["reward.fn"] = cfg.reward
    if use_wandb:
        values.update(
            {
                "logger.wandb.project": cfg.wandb.project or "lit_grpo",
                "logger.wandb.entity": cfg.wandb.entity,
                "logger.wandb.name": cfg.wandb.run_name,
                # without an API key, offline (a local run folder `wandb sync` uploads), as the cookbook does
                "logger.wandb.offline": not os.environ.get("WANDB_API_KEY"),
            }
        )
    _set_loss_knobs(composed, values, cfg)
    with open_dict(composed):
        composed.callbacks.pop("reward_filter", None)  # the cookbook filters groups only through dynamic_filter_fn
    for key, value in values.items():
        if key not in overridden:
            OmegaConf.update(composed, key, value, merge=False)
    return composed


def _set_loss_knobs(composed: DictConfig, values: dict, cfg: Config) -> None:
    """The clip range, on the losses that take it (others have it null), and the TIS settings: the
    `correction=tis` every loss gets (the cookbook's `reinforce` has none: its ratio is to the sampler)."""
    params = composed.policy_loss.params
    if params.get("eps_clip") is not None:
        values["policy_loss.params.eps_clip"] = cfg.eps_clip
    if params.get("eps_clip_high") is not None:
        values["policy_loss.params.eps_clip_high"] = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    if composed.correction.name == "tis":
        values["correction.cap"] = cfg.tis.cap
        values["correction.level"] = cfg.tis.level
