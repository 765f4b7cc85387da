"""Typed configuration: `TrainConfig` (the whole run), its few top-level knobs over one documented
dataclass per group (`lit_grpo.config.groups`, `training`, `offpolicy`, `guards`, ...), registered
in the ConfigStore.

`conf/train.yaml` starts from the `train_schema` node stored here, so every YAML under `conf/`
is merged onto these dataclasses: a misspelt key or a value of the wrong type fails while Hydra
composes. Each kind of check has one place: a field's range in its group's `__post_init__`, the
rules between a group and the rest of the run in one `check_<group>(c)` each (run by
`TrainConfig.__post_init__`), and whatever needs a registry (loss, advantage and correction
parameters, sampler kinds, tasks) in `lit_grpo.run.validate`, a layer above the registries.
`parse(cfg)` turns a composed DictConfig into these objects (renaming keys that moved,
`lit_grpo.config.moved`) before any model is loaded. A field marked `metadata=DEFINES_STATE`
defines what a checkpoint's state means (`lit_grpo.run.checkpoint.STATE_DEFINING_FIELDS`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lit_grpo.config.checks import DEFINES_STATE, MAX_LEARNING_RATE, ConfigError, require, require_finite
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
from lit_grpo.config.keys import unknown_keys, unknown_keys_message
from lit_grpo.config.model import BUILT_KINDS, ModelConfig
from lit_grpo.config.moved import rename_moved_keys
from lit_grpo.config.offpolicy import OffPolicyConfig
from lit_grpo.config.sampler import SamplerConfig, sampler_copy_reason
from lit_grpo.config.trainer import LightningTrainerConfig
from lit_grpo.config.training import BatchingConfig, CheckpointConfig, OptimConfig

MAX_SEED = 2**31 - 1
"""The largest `seed`: numpy takes seeds below 2**32, and rank r seeds with `seed + 1_000_003·r`."""


@dataclass
class TrainConfig:
    """The whole run: the few knobs nearly every run sets, then one group per job."""

    seed: int = field(default=0, metadata=DEFINES_STATE)
    """Seeds python, numpy, torch, the tiny model's init and the data order."""
    max_steps: int = -1
    """Rollout steps to train (-1: until the rows × epochs are used up)."""
    learning_rate: float = 1e-5
    """AdamW's learning rate (the peak, after warm-up; the rest of the optimizer is `optim`)."""
    resume: Optional[str] = None
    """`auto`: resume from the newest complete checkpoint in `<output_dir>/checkpoints` (start fresh
    if there is none); a path: that checkpoint (or the newest complete one under that folder); null: start fresh."""
    output_dir: str = "."
    """Run folder: logs, plots, checkpoints. Set by Hydra to its run directory."""
    output_model_id: Optional[str] = "final_model"
    """Folder (under output_dir unless absolute) the trained policy is exported to in Hugging Face
    format when fit ends (null: no export)."""
    eval_interval: int = 0
    """Greedy accuracy on `data.eval_rows` held-out rows every N rollout steps and at the end (0: at the end only)."""
    eval_at_start: bool = False
    """Also score the held-out rows before the first step (`eval/accuracy` at step 0, the summary's
    `eval_accuracy_start`): the base model's accuracy, measured by the run itself."""
    summary_metric: str = "reward/mean"
    """Metric reported in the run summary and the reward curve."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata=DEFINES_STATE)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    task: dict = field(default_factory=lambda: {"name": "arithmetic"}, metadata=DEFINES_STATE)
    """The task (`conf/task/<name>.yaml`): `name`, a registered task (`lit_grpo.tasks`) or
    `module.path:name` for a user's, plus that task's own options (e.g. `task.num_rows`), checked
    strictly against the options dataclass the task registered."""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward (`conf/reward/`): null `reward.fn` is the task's; a name, `module:function` or a
    weighted list of them replaces it."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Which rows are drawn: every row once per epoch (`none`), or weighted by each row's online pass rate."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """The advantage estimator (`conf/advantage/<name>.yaml`): grpo, dr_grpo, igpo or a user's
    `module.path:name`, with its `params`."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """The training–inference mismatch correction applied to every loss (`conf/correction/<mode>.yaml`):
    none, tis (the default), mask, icepop, geo_mask, kl_reject; and the off-policy mask's δ."""
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    """Entropy controls: a bonus (fixed, decaying or adaptive), top-entropy tokens only, an alarm."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The KL reference: frozen (the default) or moved towards the policy every `sync_every` optimizer steps."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    offpolicy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    trainer: LightningTrainerConfig = field(default_factory=LightningTrainerConfig)
    callbacks: dict = field(default_factory=dict)
    """Keyed Lightning callbacks (`_target_` dicts); drop one with `~callbacks.<key>`."""
    logger: dict = field(default_factory=dict)
    """Keyed Lightning loggers (`_target_` dicts)."""

    def __post_init__(self) -> None:
        check_top_level(self)
        for check in (
            check_optim,
            check_batching,
            check_checkpoint,
            check_offpolicy,
            check_rollout,
            check_reference,
            check_sampler_fits,
        ):
            check(self)

    @property
    def adapter_sync(self) -> bool:
        """Whether a weight sync sends only the LoRA adapter (`sampler.lora_sync`)."""
        return self.model.lora.rank > 0 and self.sampler.lora_sync_mode == "adapter"

    def why_the_sampler_copies_the_policy(self) -> Optional[str]:
        """Why the sampler needs a copy of the policy's weights (None: it can generate with the policy itself)."""
        return sampler_copy_reason(
            self.sampler.kind, self.offpolicy.synchronous, self.offpolicy.weight_sync_interval, self.trainer.strategy
        )

    @property
    def sampler_shares_policy_weights(self) -> bool:
        """Whether the `hf` sampler generates with the policy itself: no copy of the weights, no sync copies."""
        return self.sampler.share_policy_weights != "false" and self.why_the_sampler_copies_the_policy() is None


def check_top_level(c: TrainConfig) -> None:
    """The top-level fields' ranges."""
    require(c.max_steps == -1 or c.max_steps > 0, "max_steps", "must be -1 (until data is exhausted) or > 0")
    require(
        isinstance(c.seed, int) and 0 <= c.seed <= MAX_SEED,
        "seed",
        f"must be an integer in [0, {MAX_SEED}] (numpy's bound less the ranks' offsets), got {c.seed!r}",
    )
    require_finite(c.learning_rate, "learning_rate")
    require(
        0 < c.learning_rate <= MAX_LEARNING_RATE,
        "learning_rate",
        f"must be in (0, {MAX_LEARNING_RATE:g}], got {c.learning_rate}",
    )
    require(c.eval_interval >= 0, "eval_interval", "must be >= 0 (0: evaluate at the end only)")
    require(c.resume is None or bool(c.resume.strip()), "resume", "must be null, 'auto' or a checkpoint path")
    require(
        c.output_model_id is None or bool(c.output_model_id.strip()),
        "output_model_id",
        "must be null or a folder name",
    )


# The rules between one group and the rest of the run: one function per group, run by
# `TrainConfig.__post_init__` (each field's own range is its group's `__post_init__`).


def check_optim(c: TrainConfig) -> None:
    """A decay needs the run's length."""
    require(
        c.optim.lr_decay == "constant" or c.max_steps > 0,
        "optim.lr_decay",
        f"{c.optim.lr_decay!r} decay needs max_steps > 0",
    )


def check_batching(c: TrainConfig) -> None:
    """Every minibatch has a sequence."""
    batch_size = c.data.prompt_groups_per_step * c.data.completions_per_prompt
    require(
        c.batching.ppo_minibatches <= batch_size,
        "batching.ppo_minibatches",
        f"must be <= the sequences per step (prompt_groups_per_step × completions_per_prompt = {batch_size})",
    )


def check_checkpoint(c: TrainConfig) -> None:
    """A checkpoint is taken when the sampler holds the saved policy."""
    every, sync = c.checkpoint.save_interval, c.offpolicy.weight_sync_interval
    require(
        every == 0 or sync == 0 or every % sync == 0,
        "checkpoint.save_interval",
        f"must be a multiple of offpolicy.weight_sync_interval ({sync}) so a checkpoint is taken when the "
        "sampler holds the saved policy (an exact resume needs both)",
    )


def check_offpolicy(c: TrainConfig) -> None:
    """The sampler can do what the schedule asks of it."""
    o = c.offpolicy
    if c.adapter_sync and c.sampler.kind == "vllm_server":  # in-process engines never run a call across a sync
        require(
            o.synchronous or c.sampler.max_loras >= o.max_lag + 2,
            "sampler.max_loras",
            f"must be >= offpolicy.max_lag + 2 = {o.max_lag + 2} with adapter "
            "sync: the rollouts still running on older adapters keep them loaded",
        )
    require(
        not o.partial_rollouts or c.sampler.kind in ("vllm_server", "hf"),
        "offpolicy.partial_rollouts",
        f"needs sampler.kind=vllm_server (completions interrupted by a sync and continued) or hf "
        f"(tokens tagged by generate call); sampler.kind={c.sampler.kind} does not tag its tokens' versions",
    )
    copy_reason = c.why_the_sampler_copies_the_policy()
    require(
        c.sampler.share_policy_weights != "true" or copy_reason is None,
        "sampler.share_policy_weights",
        f"true needs a sampler that never generates while the policy trains, but {copy_reason}",
    )


def check_rollout(c: TrainConfig) -> None:
    """Rows are admitted whole, and the overlong penalty starts inside the completion budget."""
    require(
        c.rollout.max_concurrency >= c.data.completions_per_prompt,
        "rollout.max_concurrency",
        f"must be >= data.completions_per_prompt ({c.data.completions_per_prompt}): rows are admitted whole",
    )
    require(
        c.rollout.overlong_buffer_len < c.sampler.max_completion_tokens,
        "rollout.overlong_buffer_len",
        f"must be < sampler.max_completion_tokens ({c.sampler.max_completion_tokens}): the penalty starts "
        f"at max_completion_tokens - overlong_buffer_len generated tokens, got {c.rollout.overlong_buffer_len}",
    )


def check_reference(c: TrainConfig) -> None:
    """A moving reference needs a reference, and one made of weights of its own (not LoRA's base)."""
    if not c.reference.moves:
        return
    require(
        c.policy_loss.kl_beta > 0,
        "reference.sync_every",
        f"={c.reference.sync_every} needs policy_loss.kl_beta > 0: with kl_beta=0 there is no reference to move",
    )
    require(
        c.model.lora.rank == 0,
        "reference.sync_every",
        f"={c.reference.sync_every} cannot go with LoRA (model.lora.rank={c.model.lora.rank}): the reference is "
        "the base model with the adapters off, and moving it would rewrite the base weights the adapters, their "
        "optimizer state and the sampler are built on (α=1 could be a merge of the adapters, α<1 cannot be "
        "expressed at all); keep the reference frozen (reference.sync_every=0) or train without LoRA",
    )


def check_sampler_fits(c: TrainConfig) -> None:
    """The sampler can run the model: a vision-language policy built here samples with vLLM only in
    an architecture vLLM can run here (its Qwen2-VL needs torchvision), and not as partial rollouts
    (their streams take no images); vLLM's CPU attention needs a head size of 32 or more."""
    if c.model.kind == "tiny_vlm" and c.sampler.kind in ("vllm", "vllm_server"):
        require(
            c.model.vlm_arch != "qwen2_vl" or importlib.util.find_spec("torchvision") is not None,
            "model.vlm_arch",
            f"=qwen2_vl cannot be sampled with sampler={c.sampler.kind}: vLLM's Qwen2-VL needs torchvision, "
            "which is not installed; use model.vlm_arch=idefics3 (with model.num_heads=2), sampler=hf, "
            "or install torchvision",
        )
        require(
            not (c.sampler.kind == "vllm_server" and c.offpolicy.partial_rollouts),
            "offpolicy.partial_rollouts",
            "cannot go with a vision-language policy: partial rollouts stream from /v1/completions, "
            "which takes no images; set offpolicy.partial_rollouts=false",
        )
    if c.sampler.kind == "vllm" and c.model.kind in BUILT_KINDS:
        head_dim = c.model.hidden_size // c.model.num_heads
        require(
            head_dim >= 32,
            "model.num_heads",
            f"vLLM's CPU attention needs a head size >= 32, got {head_dim}; "
            f"try model.num_heads={max(c.model.hidden_size // 32, 1)}",
        )


def register_configs() -> None:
    """Store the schema so `conf/train.yaml` can start from it (`defaults: [train_schema, ...]`)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


def parse(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """A composed config as `TrainConfig`, with every check one group or field can make alone
    (`lit_grpo.run.validate.validate` adds those that need a registry). Raises `ConfigError`
    naming the field; nothing has been loaded yet when it does.
    """
    if isinstance(cfg, TrainConfig):
        return cfg
    renamed = rename_moved_keys(cfg)  # a config built in Python (or saved by an older release) with old names
    if renamed is not cfg:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), renamed)
        assert isinstance(merged, DictConfig)  # merged onto the schema's node
        cfg = merged
    if problems := unknown_keys(cfg, TrainConfig):  # a misspelt `+key=value`: to_object would drop it silently
        raise ConfigError(unknown_keys_message(problems))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise ConfigError("config does not follow the train schema; compose it from conf/train.yaml")
    return obj


register_configs()
