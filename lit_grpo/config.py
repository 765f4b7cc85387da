"""Typed configuration: one documented dataclass per Hydra group, registered in the ConfigStore.

`conf/train.yaml` starts from the `train_schema` node stored here, so every YAML under `conf/`
is merged onto these dataclasses: a misspelt key or a value of the wrong type fails while Hydra
composes. Cross-field rules live in `__post_init__`; `validate(cfg)` turns a composed DictConfig
into these objects (running those rules) before any model is loaded. Lists of valid names (loss
variants, normalizations, TIS levels, advantage scales, sampler kinds, tasks) are read from the
registries that own them, never written here. A field marked `metadata=DEFINES_STATE` defines what
a checkpoint's state means (`lit_grpo.checkpoint.STATE_DEFINING_FIELDS`); `ineffective_knobs`
names the knobs that a given config makes no-ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lit_grpo.config_keys import unknown_keys, unknown_keys_message
from lit_grpo.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value that cannot work; the message names the field."""


def require(ok: bool, field_name: str, message: str) -> None:
    """Raise `ConfigError` naming `field_name` (its dotted path, e.g. `task.num_rows`) unless `ok`."""
    if not ok:
        raise ConfigError(f"config field `{field_name}`: {message}")


def require_finite(value: Any, field_name: str) -> None:
    """Raise `ConfigError` unless `value` is a finite number (NaN and ±inf pass the usual `> 0` checks badly)."""
    require(isinstance(value, (int, float)) and math.isfinite(value), field_name, f"must be a finite number, got {value!r}")


MAX_TEMPERATURE = 100.0
"""Above this the sampling distribution is uniform to any precision: a typo, not a setting."""
MAX_LEARNING_RATE = 1.0


DEFINES_STATE = {"defines_state": True}
"""Field metadata: the field defines what a checkpoint's state means, so resuming with another
value is refused (`lit_grpo.checkpoint.check_resumable`). On a sub-config: all of it."""


@dataclass
class ModelConfig:
    """The policy model. `kind=tiny` builds a random-init model locally; `kind=hf` loads one."""

    kind: str = "tiny"
    """`tiny` (built from the fields below, no download) or `hf` (`AutoModelForCausalLM`)."""
    name_or_path: Optional[str] = None
    """Hub name or local folder of the model and tokenizer when `kind=hf`."""
    hidden_size: int = 64
    """Tiny model: width of the residual stream."""
    num_layers: int = 2
    """Tiny model: number of decoder layers."""
    num_heads: int = 4
    """Tiny model: attention heads."""
    intermediate_size: int = 256
    """Tiny model: MLP width."""
    max_position_embeddings: int = 256
    """Tiny model: longest sequence it can read."""
    alphabet: str = "printable"
    """Tiny model: characters of the tokenizer; `printable` (ASCII) or `arithmetic` (digits, signs)."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Passed to transformers when `kind=hf`."""

    def __post_init__(self) -> None:
        require(self.kind in ("tiny", "hf"), "model.kind", f"must be 'tiny' or 'hf', got {self.kind!r}")
        require(
            self.kind != "hf" or bool(self.name_or_path),
            "model.name_or_path",
            "is required when model.kind=hf (a hub name or a local folder)",
        )
        require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", f"unknown dtype {self.dtype!r}")
        require(self.alphabet in ("printable", "arithmetic"), "model.alphabet", "must be 'printable' or 'arithmetic'")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"model.{name}", "must be > 0")
        require(self.hidden_size % self.num_heads == 0, "model.hidden_size", "must be divisible by model.num_heads")


@dataclass
class SamplerConfig:
    """The in-process sampler that produces rollouts."""

    kind: str = "hf"
    """A registered sampler (`lit_grpo.samplers`): `hf`, batched transformers `generate` with its own
    copy of the weights; `vllm`, in-process vLLM."""
    temperature: float = 1.0
    """Sampling temperature; logprobs are reported at this temperature (top_p=1, top_k=0)."""
    max_completion_tokens: int = 8
    """Most tokens generated per completion."""
    max_batch_size: int = 256
    """Most sequences generated together in one batched call."""
    dtype: str = "auto"
    """vllm: engine dtype (`auto` follows the model; float32 for exact logprob checks)."""
    max_model_len: Optional[int] = None
    """vllm: longest prompt + completion the engine accepts (null: the model's own limit)."""
    gpu_memory_utilization: float = 0.3
    """vllm on CUDA: fraction of GPU memory for the engine (the rest is the trainer's, colocated)."""
    enforce_eager: bool = False
    """vllm: no CUDA graphs (faster start, slower decode)."""
    tensor_parallel_size: int = 1
    """vllm on CUDA: GPUs the engine shards over."""
    sleep_between_phases: bool = False
    """vllm on CUDA: free the engine's memory while the trainer steps (CPU: ignored, with a log line)."""

    def __post_init__(self) -> None:
        from lit_grpo.samplers import available_samplers

        require(self.kind in available_samplers(), "sampler.kind", f"unknown sampler {self.kind!r}; valid: {', '.join(available_samplers())}")
        require_finite(self.temperature, "sampler.temperature")
        require(0 < self.temperature <= MAX_TEMPERATURE, "sampler.temperature", f"must be in (0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        require(self.max_completion_tokens > 0, "sampler.max_completion_tokens", "must be > 0")
        require(self.max_batch_size > 0, "sampler.max_batch_size", "must be > 0")
        require(0 < self.gpu_memory_utilization <= 1, "sampler.gpu_memory_utilization", "must be in (0, 1]")
        require(self.tensor_parallel_size >= 1, "sampler.tensor_parallel_size", "must be >= 1")


@dataclass
class DataConfig:
    """How the task's rows are grouped into steps: what every task shares (the task's own options
    are the `task` group)."""

    completions_per_prompt: int = field(default=8, metadata=DEFINES_STATE)
    """G: completions sampled per prompt; advantages are relative within these."""
    prompt_groups_per_step: int = field(default=8, metadata=DEFINES_STATE)
    """P: accepted prompt groups per training step (B = P·G sequences)."""
    max_rows: int = field(default=0, metadata=DEFINES_STATE)
    """Use at most this many rows of the task's dataset (0: all)."""
    epochs: int = 1
    """Passes over the rows; rows are reshuffled each epoch with the run seed."""
    max_seq_len: int = 256
    """Longest prompt + completion, in tokens."""
    shuffle: bool = field(default=True, metadata=DEFINES_STATE)
    """Shuffle rows each epoch (seeded)."""
    min_group_size: int = 2
    """A group left with fewer samples (after dropped or failed rollouts) is dropped."""
    eval_rows: int = 0
    """Held-out rows of the task scored greedily for `eval/accuracy` (0: no evaluation)."""

    def __post_init__(self) -> None:
        require(self.eval_rows >= 0, "data.eval_rows", "must be >= 0 (0: no evaluation)")
        require(self.completions_per_prompt >= 2, "data.completions_per_prompt", "must be >= 2 (advantages are relative within a group)")
        require(self.prompt_groups_per_step >= 1, "data.prompt_groups_per_step", "must be >= 1")
        require(self.max_rows >= 0, "data.max_rows", "must be >= 0 (0 means all rows)")
        require(self.epochs >= 1, "data.epochs", "must be >= 1")
        require(self.max_seq_len > 1, "data.max_seq_len", "must be > 1")
        require(
            2 <= self.min_group_size <= self.completions_per_prompt,
            "data.min_group_size",
            "must be between 2 and data.completions_per_prompt",
        )


@dataclass
class RolloutConfig:
    """The rollout function: the user's extension point."""

    factory: str = "lit_grpo.rollout:make_rollout_fn"
    """`module:function` of a `make_rollout_fn(setup) -> rollout_fn`, importable from the working directory."""
    extras: dict = field(default_factory=dict)
    """Anything the factory needs, handed over as `setup.extras` (next to `reward_fn`)."""

    def __post_init__(self) -> None:
        require(":" in self.factory, "rollout.factory", f"must be 'module:function', got {self.factory!r}")


# PolicyLossConfig's named hyper-parameters; any other goes in `params`.
_NAMED_LOSS_HYPERPARAMS = ("eps_clip", "eps_clip_high", "eps_clip_c", "dro_beta", "tis_cap", "tis_level")


@dataclass
class PolicyLossConfig:
    """The policy objective; `conf/policy_loss/<name>.yaml` holds each built-in variant's defaults.

    Variant hyper-parameters are null unless the variant takes them; validation checks every one
    that is set (named here or in `params`) against the loss registry, so a hyper-parameter the
    variant does not take is an error naming its field, not a silent no-op.
    """

    name: str = field(default="grpo", metadata=DEFINES_STATE)
    """A registered variant (`lit_grpo.losses`: grpo, importance_sampling, reinforce, dapo, dro,
    gspo, cispo), or `module.path:name` for a user's loss: `module.path` is imported first (the
    working directory is importable) and its `@register_policy_loss("name")` registers it."""
    kl_beta: float = 0.001
    """β of the k3 KL penalty to the frozen reference; > 0 builds the reference model."""
    loss_normalization: str = "token_mean"
    """A registered normalization (`lit_grpo.loss_terms.LOSS_NORMALIZATIONS`): token_mean (over
    the whole optimizer step), seq_mean or sum."""
    advantage_scale: str = "std"
    """`std`: (r - mean) / std within the group; `none`: r - mean (Dr. GRPO)."""
    eps_clip: Optional[float] = None
    """Lower clip ε of the ratio (1 - ε)."""
    eps_clip_high: Optional[float] = None
    """Upper clip ε of the ratio (1 + ε)."""
    eps_clip_c: Optional[float] = None
    """dapo's dual-clip constant c for negative advantages (null: off)."""
    dro_beta: Optional[float] = None
    """dro's quadratic penalty β."""
    tis_cap: Optional[float] = None
    """Cap of the truncated importance weight against the sampler's logprobs."""
    tis_level: Optional[str] = None
    """`token` or `sequence` TIS weights (`lit_grpo.loss_terms.TIS_LEVELS`)."""
    params: dict = field(default_factory=dict)
    """Any other hyper-parameter of the registered loss, by the name it was registered with
    (`register_policy_loss("mine", scale=1.0)`: `+policy_loss.params.scale=3.0`)."""

    def __post_init__(self) -> None:
        from lit_grpo.advantages import ADVANTAGE_SCALES
        from lit_grpo.losses import LOSS_NORMALIZATIONS, check_policy_loss_hyperparams, policy_loss_defaults

        require_finite(self.kl_beta, "policy_loss.kl_beta")
        require(self.kl_beta >= 0, "policy_loss.kl_beta", f"must be >= 0, got {self.kl_beta}")
        for key in ("eps_clip", "eps_clip_high", "eps_clip_c", "dro_beta", "tis_cap"):
            if getattr(self, key) is not None:
                require_finite(getattr(self, key), f"policy_loss.{key}")
        require(
            self.loss_normalization in LOSS_NORMALIZATIONS,
            "policy_loss.loss_normalization",
            f"must be one of {', '.join(LOSS_NORMALIZATIONS)}, got {self.loss_normalization!r}",
        )
        require(self.advantage_scale in ADVANTAGE_SCALES, "policy_loss.advantage_scale", f"must be one of {', '.join(ADVANTAGE_SCALES)}, got {self.advantage_scale!r}")
        try:
            defaults = policy_loss_defaults(self.name)
        except ValueError as err:
            raise ConfigError(f"config field `policy_loss.name`: {err}") from None
        valid = f"valid hyper-parameters of {self.name!r}: {', '.join(sorted(defaults))}"
        for key in _NAMED_LOSS_HYPERPARAMS:
            require(getattr(self, key) is None or key in defaults, f"policy_loss.{key}", f"the loss does not take it; {valid}")
        for key in self.params:
            require(key not in (*_NAMED_LOSS_HYPERPARAMS, "kl_beta"), f"policy_loss.params.{key}", f"set it as policy_loss.{key}")
            require(key in defaults, f"policy_loss.params.{key}", f"the loss does not take it; {valid}")
        try:
            check_policy_loss_hyperparams(self.name, self.hyperparams())
        except ValueError as err:
            raise ConfigError(f"config group `policy_loss`: {err}") from None

    def hyperparams(self) -> dict[str, Any]:
        """The hyper-parameters to call the loss with: the named ones that are set, `params`, kl_beta."""
        named = {n: getattr(self, n) for n in _NAMED_LOSS_HYPERPARAMS if getattr(self, n) is not None}
        return {**named, **self.params, "kl_beta": self.kl_beta}


@dataclass
class TrainerConfig:
    """Arguments of `lightning.Trainer` that lit_grpo exposes; `extra` passes any other one."""

    accelerator: str = "auto"
    devices: Any = 1
    strategy: str = "auto"
    precision: str = "32-true"
    max_epochs: int = 1
    """One Lightning epoch is the whole rollout stream (all data epochs)."""
    fast_dev_run: Any = False
    """True or N: run 1 (or N) steps as a smoke test, no checkpoints, no plots."""
    log_every_n_steps: int = 1
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    deterministic: bool = False
    extra: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    """The whole run. Top-level fields are the cookbook Config's knobs, under the same names."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata=DEFINES_STATE)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    task: dict = field(default_factory=lambda: {"name": "arithmetic"}, metadata=DEFINES_STATE)
    """The task (`conf/task/<name>.yaml`): `name`, a registered task (`lit_grpo.tasks`) or
    `module.path:name` for a user's, plus that task's own options (e.g. `task.num_rows`), checked
    strictly against the options dataclass the task registered."""
    data: DataConfig = field(default_factory=DataConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    callbacks: dict = field(default_factory=dict)
    """Keyed Lightning callbacks (`_target_` dicts); drop one with `~callbacks.<key>`."""
    logger: dict = field(default_factory=dict)
    """Keyed Lightning loggers (`_target_` dicts)."""

    seed: int = field(default=0, metadata=DEFINES_STATE)
    """Seeds python, numpy, torch, the tiny model's init and the data order."""
    max_steps: int = -1
    """Rollout steps to train (-1: until the rows × epochs are used up)."""
    learning_rate: float = 1e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm (0: off)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    lr_decay: str = "constant"
    """After warm-up: `constant`, or `linear` / `cosine` decay to 0 at the last step (needs max_steps)."""
    weight_sync_interval: int = 1
    """Push the policy into the sampler every N steps (1: on-policy; 0: never, the sampler keeps the base weights)."""
    dcp_save_interval: int = 0
    """Save a resumable DCP checkpoint every N rollout steps, and after the last one (0: off)."""
    dcp_keep_last: int = 2
    """Complete checkpoints kept in `<output_dir>/checkpoints` (older ones are deleted)."""
    resume: Optional[str] = None
    """`auto`: resume from the newest complete checkpoint in `<output_dir>/checkpoints` (start fresh
    if there is none); a path: that checkpoint (or the newest complete one under that folder); null: start fresh."""
    output_model_id: Optional[str] = "final_model"
    """Folder (under output_dir unless absolute) the trained policy is exported to in Hugging Face
    format when fit ends (null: no export)."""
    synchronous_training: bool = False
    """Sample a step's groups, then train, then sync: no overlap (the on-policy baseline)."""
    max_head_offpolicy_versions: int = 0
    """O: a sample may be trained at most O weight-sync versions after it was sampled (0: on-policy)."""
    max_concurrency_rollout_sample: int = 256
    """Most rollout calls in flight at once (asynchronous mode)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward; gradients accumulate over a step (0: the whole batch)."""
    ppo_n_minibatches: int = field(default=1, metadata=DEFINES_STATE)
    """K: optimizer steps per rollout batch, each on 1/K of it, all against the same old policy."""
    output_dir: str = "."
    """Run folder: logs, plots, checkpoints. Set by Hydra to its run directory."""
    summary_metric: str = "reward/mean"
    """Metric reported in the run summary and the reward curve."""
    eval_interval: int = 0
    """Greedy accuracy on `data.eval_rows` held-out rows every N rollout steps and at the end (0: at the end only)."""
    rollout_timeout_s: float = 300.0
    """Deadline of each rollout call, in seconds: a call still running is cancelled and counted in
    `rollout/timeouts` (retried like any transient error, then a `rollout/failures`). It also bounds
    each batched sampler call, and how long the rollout event loop may go without running: a
    rollout that blocks it (`time.sleep` in an async rollout) stops the run with `RolloutStalled`."""
    rollout_max_retries: int = 2
    """Retries of a rollout call that ended in a transient error (a timeout, `ConnectionError`,
    `OSError`), with backoff 0.5 s, 1 s, 2 s, ...; counted in `rollout/retries`. A bug in the rollout
    (`TypeError`, `KeyError`, ...) is never retried: it stops the run at once."""
    max_rows_without_progress: int = 1000
    """Consecutive rows sampled without one accepted group before the run stops with
    `NoProgressError`, whose message counts the rows per drop reason (None returned, malformed
    samples, non-finite rewards, uniform groups filtered, prompts too long, failures)."""
    max_nonfinite_steps: int = 3
    """Consecutive training steps whose loss or gradient norm is non-finite before the run stops;
    each such step's update is skipped."""

    def __post_init__(self) -> None:
        require(self.max_steps == -1 or self.max_steps > 0, "max_steps", "must be -1 (until data is exhausted) or > 0")
        for name in ("learning_rate", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "grad_clip_norm", "rollout_timeout_s"):
            require_finite(getattr(self, name), name)
        require(0 < self.learning_rate <= MAX_LEARNING_RATE, "learning_rate",
                f"must be in (0, {MAX_LEARNING_RATE:g}], got {self.learning_rate}")
        require(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        require(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        require(self.adam_eps > 0, "adam_eps", "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.grad_clip_norm >= 0, "grad_clip_norm", "must be >= 0 (0: off)")
        require(self.rollout_timeout_s > 0, "rollout_timeout_s", f"must be > 0 seconds, got {self.rollout_timeout_s}")
        require(0 <= self.rollout_max_retries <= 10, "rollout_max_retries", f"must be in [0, 10], got {self.rollout_max_retries}")
        require(self.max_rows_without_progress >= 1, "max_rows_without_progress", "must be >= 1")
        require(self.max_nonfinite_steps >= 1, "max_nonfinite_steps", "must be >= 1")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.lr_decay in ("constant", "linear", "cosine"), "lr_decay", "must be constant, linear or cosine")
        require(self.lr_decay == "constant" or self.max_steps > 0, "lr_decay", f"{self.lr_decay!r} decay needs max_steps > 0")
        require(self.weight_sync_interval >= 0, "weight_sync_interval", "must be >= 0 (0: never sync)")
        require(self.dcp_save_interval >= 0, "dcp_save_interval", "must be >= 0 (0: off)")
        require(self.dcp_keep_last >= 1, "dcp_keep_last", "must be >= 1")
        require(self.eval_interval >= 0, "eval_interval", "must be >= 0 (0: evaluate at the end only)")
        require(
            self.dcp_save_interval == 0 or self.weight_sync_interval == 0 or self.dcp_save_interval % self.weight_sync_interval == 0,
            "dcp_save_interval",
            f"must be a multiple of weight_sync_interval ({self.weight_sync_interval}) so a checkpoint is taken when the "
            "sampler holds the saved policy (an exact resume needs both)",
        )
        require(self.resume is None or bool(self.resume.strip()), "resume", "must be null, 'auto' or a checkpoint path")
        require(self.output_model_id is None or bool(self.output_model_id.strip()), "output_model_id", "must be null or a folder name")
        require(self.max_head_offpolicy_versions >= 0, "max_head_offpolicy_versions", "must be >= 0 (0: on-policy)")
        require(
            self.synchronous_training or self.weight_sync_interval <= self.max_head_offpolicy_versions + 1,
            "weight_sync_interval",
            f"must be <= max_head_offpolicy_versions + 1 = {self.max_head_offpolicy_versions + 1} with the off-policy "
            "scheduler (synchronous_training=false): the gate admits rows at most that many versions ahead, so a "
            "longer sync window would wait forever for rollouts",
        )
        require(
            self.max_concurrency_rollout_sample >= self.data.completions_per_prompt,
            "max_concurrency_rollout_sample",
            f"must be >= data.completions_per_prompt ({self.data.completions_per_prompt}): rows are admitted whole",
        )
        require(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0 (0: whole batch)")
        require(self.ppo_n_minibatches >= 1, "ppo_n_minibatches", "must be >= 1")
        batch_size = self.data.prompt_groups_per_step * self.data.completions_per_prompt
        require(
            self.ppo_n_minibatches <= batch_size,
            "ppo_n_minibatches",
            f"must be <= the sequences per step (prompt_groups_per_step × completions_per_prompt = {batch_size})",
        )
        if self.sampler.kind == "vllm" and self.model.kind == "tiny":
            head_dim = self.model.hidden_size // self.model.num_heads
            require(head_dim >= 32, "model.num_heads", f"vLLM's CPU attention needs a head size >= 32, got {head_dim}; try model.num_heads={max(self.model.hidden_size // 32, 1)}")
        from lit_grpo.tasks import check_task

        check_task(self)


def ineffective_knobs(c: TrainConfig) -> list[str]:
    """One message per knob that this config sets but that has no effect in it (logged at start-up).

    A knob at its default is not reported: only values someone chose and that do nothing.
    """
    knobs = []
    if c.synchronous_training and c.max_head_offpolicy_versions > 0:
        knobs.append(
            f"max_head_offpolicy_versions={c.max_head_offpolicy_versions} has no effect with synchronous_training=true: "
            "every rollout is drained before each step, so none is ever off-policy"
        )
    if c.eval_interval > 0 and c.data.eval_rows == 0:
        knobs.append(f"eval_interval={c.eval_interval} has no effect with data.eval_rows=0: there is nothing to evaluate")
    default_keep = TrainConfig.__dataclass_fields__["dcp_keep_last"].default
    if c.dcp_save_interval == 0 and c.dcp_keep_last != default_keep:
        knobs.append(f"dcp_keep_last={c.dcp_keep_last} has no effect with dcp_save_interval=0: no checkpoint is saved")
    return knobs


def register_configs() -> None:
    """Store the schema so `conf/train.yaml` can start from it (`defaults: [train_schema, ...]`)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


def validate(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """Turn a composed config into `TrainConfig`, running every cross-field check.

    Raises `ConfigError` naming the field; nothing has been loaded yet when it does.
    """
    if isinstance(cfg, TrainConfig):
        return cfg
    if problems := unknown_keys(cfg, TrainConfig):  # a misspelt `+key=value`: to_object would drop it silently
        raise ConfigError(unknown_keys_message(problems))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise ConfigError("config does not follow the train schema; compose it from conf/train.yaml")
    return obj


register_configs()
