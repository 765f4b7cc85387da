"""Typed configuration: `TrainConfig` (the whole run) over one documented dataclass per Hydra group
(`lit_grpo.config.groups`, re-exported here), registered in the ConfigStore.

`conf/train.yaml` starts from the `train_schema` node stored here, so every YAML under `conf/`
is merged onto these dataclasses: a misspelt key or a value of the wrong type fails while Hydra
composes. Cross-field rules live in `__post_init__`; `parse(cfg)` turns a composed DictConfig
into these objects (running those rules) before any model is loaded. Lists of valid names (loss
variants, normalizations, TIS levels, advantage scales, sampler kinds, tasks) belong to the
registries that own them: `lit_grpo.run.validate` checks them, a layer above the registries. A
field marked `metadata=DEFINES_STATE` defines what
a checkpoint's state means (`lit_grpo.run.checkpoint.STATE_DEFINING_FIELDS`); `ineffective_knobs`
names the knobs that a given config makes no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lit_grpo.config.checks import (
    DEFINES_STATE,
    MAX_LEARNING_RATE,
    ConfigError,
    exception_class,
    require,
    require_finite,
)
from lit_grpo.config.controls import CorrectionConfig, EntropyConfig, adopt_legacy_tis
from lit_grpo.config.groups import (
    AdvantageConfig,
    DataConfig,
    PolicyLossConfig,
    RewardConfig,
    RolloutConfig,
    adopt_legacy_advantage,
)
from lit_grpo.config.keys import unknown_keys, unknown_keys_message
from lit_grpo.config.model import BUILT_KINDS, ModelConfig
from lit_grpo.config.sampler import SamplerConfig, sampler_copy_reason
from lit_grpo.config.trainer import TrainerConfig

MAX_SEED = 2**31 - 1
"""The largest `seed`: numpy takes seeds below 2**32, and rank r seeds with `seed + 1_000_003·r`."""
ANCHORS = ("old_policy", "rollout")
"""`anchor_logp`: the trainer's logprobs before the update, or the sampler's."""


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
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward (`conf/reward/`): null `reward.fn` is the task's; a name, `module:function` or a
    weighted list of them replaces it."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """The advantage estimator (`conf/advantage/<name>.yaml`): grpo, dr_grpo, igpo or a user's
    `module.path:name`, with its `params`. The deprecated `policy_loss.advantage`,
    `policy_loss.advantage_scale`, `policy_loss.igpo_gamma` and `policy_loss.igpo_skip_last_ig`
    are read into it here (`lit_grpo.config.groups.adopt_legacy_advantage`)."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """The training–inference mismatch correction applied to every loss (`conf/correction/<mode>.yaml`):
    none, tis (the default), mask, icepop, geo_mask, kl_reject; and the off-policy mask's δ. The
    deprecated `policy_loss.tis_cap` / `policy_loss.tis_level` are read into it here."""
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    """Entropy controls: a bonus (fixed, decaying or adaptive), top-entropy tokens only, an alarm."""
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
    """AdamW's learning rate (the peak, after warm-up)."""
    adam_beta1: float = 0.9
    """AdamW's β1, the decay of the gradient's running mean."""
    adam_beta2: float = 0.999
    """AdamW's β2, the decay of the squared gradient's running mean."""
    adam_eps: float = 1e-8
    """AdamW's ε, added to the root of the squared-gradient mean."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
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
    partial_rollouts: bool = False
    """In-flight weight updates (asynchronous training): every generated token is tagged with the
    version of the weights that produced it, and a group counts at its oldest token's version. With
    `sampler.kind=vllm_server` a weight sync interrupts the completions being generated and each
    goes on after it on the new weights; with `hf` a sync waits for the running generate call, so a
    completion has one version, and a multi-turn rollout's turns each their own."""
    max_rollout_versions: int = 0
    """With partial rollouts: the most weight versions one trajectory may span (a group with one
    that spans more is sampled again); 0: no bound but the off-policy gate's."""
    max_concurrency_rollout_sample: int = 256
    """Most rollout calls in flight at once (asynchronous mode)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward; gradients accumulate over a step (0: the whole batch)."""
    micro_batch_max_tokens: int = 0
    """Padded tokens per forward/backward (0: off, micro-batches are `micro_batch_size` rows of the
    batch padded to its longest sequence). When > 0, a step's sequences are grouped by length, each
    micro-batch cut to its own longest one, so that rows × that length stays within this budget; a
    sequence longer than the budget goes alone. With `micro_batch_size` > 0 too, both bounds apply.
    The gradient is the same either way; the memory of a forward follows the budget, not the longest sample."""
    ppo_n_minibatches: int = field(default=1, metadata=DEFINES_STATE)
    """K: optimizer steps per rollout batch, each on 1/K of it, all against the same old policy."""
    anchor_logp: str = "old_policy"
    """What the loss's ratio is anchored on ("old"): `old_policy`, the trainer's logprobs before
    this batch's first update (a no-gradient forward when ppo_n_minibatches > 1); or `rollout`, the
    sampler's logprobs, which skips that forward and makes the mismatch correction an identity
    (the cookbook's `anchor_logp`, verl's bypass mode)."""
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
    """Retries of a rollout call that ended in a transient error (`rollout_retry_on`), with backoff
    0.5 s, 1 s, 2 s, ...; counted in `rollout/retries`. A bug in the rollout (`TypeError`,
    `KeyError`, ...) is never retried: it stops the run at once."""
    rollout_retry_on: list[str] = field(default_factory=lambda: ["TimeoutError", "ConnectionError", "OSError"])
    """The exceptions (builtin names, or `module.Class` paths) of a rollout call that are retried;
    any other (not a bug) drops the call's sample, counted in `rollout/failures`."""
    rollout_failure_share: float = 0.5
    """The run stops when at least this share of the last `rollout_failure_window` rows failed (a
    row fails when every rollout call of it raised), or 5 rows in a row did; below that a failed
    row only drops its group (`rollout/failures`)."""
    rollout_failure_window: int = 20
    """The rows `rollout_failure_share` is taken over."""
    max_rows_without_progress: int = 1000
    """Consecutive rows sampled without one accepted group before the run stops with
    `NoProgressError`, whose message counts the rows per drop reason (None returned, malformed
    samples, non-finite rewards, uniform groups filtered, prompts too long, failures)."""
    max_nonfinite_steps: int = 3
    """Consecutive training steps whose loss or gradient norm is non-finite before the run stops;
    each such step's update is skipped."""

    def __post_init__(self) -> None:
        self.advantage = adopt_legacy_advantage(self.policy_loss, self.advantage)
        self.correction = adopt_legacy_tis(self.policy_loss.tis_cap, self.policy_loss.tis_level, self.correction)
        self.policy_loss.tis_cap = self.policy_loss.tis_level = None
        require(
            self.anchor_logp in ANCHORS, "anchor_logp", f"must be one of {', '.join(ANCHORS)}, got {self.anchor_logp!r}"
        )
        require(self.max_steps == -1 or self.max_steps > 0, "max_steps", "must be -1 (until data is exhausted) or > 0")
        require(
            isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
            "seed",
            f"must be an integer in [0, {MAX_SEED}] (numpy's bound less the ranks' offsets), got {self.seed!r}",
        )
        for name in (
            "learning_rate",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "weight_decay",
            "grad_clip_norm",
            "rollout_timeout_s",
        ):
            require_finite(getattr(self, name), name)
        require(
            0 < self.learning_rate <= MAX_LEARNING_RATE,
            "learning_rate",
            f"must be in (0, {MAX_LEARNING_RATE:g}], got {self.learning_rate}",
        )
        require(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        require(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        require(self.adam_eps > 0, "adam_eps", "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.grad_clip_norm >= 0, "grad_clip_norm", "must be >= 0 (0: off)")
        require(self.rollout_timeout_s > 0, "rollout_timeout_s", f"must be > 0 seconds, got {self.rollout_timeout_s}")
        require(
            0 <= self.rollout_max_retries <= 10,
            "rollout_max_retries",
            f"must be in [0, 10], got {self.rollout_max_retries}",
        )
        require(self.max_rows_without_progress >= 1, "max_rows_without_progress", "must be >= 1")
        require_finite(self.rollout_failure_share, "rollout_failure_share")
        require(0 < self.rollout_failure_share <= 1, "rollout_failure_share", "must be in (0, 1]")
        require(self.rollout_failure_window >= 1, "rollout_failure_window", "must be >= 1")
        for name in self.rollout_retry_on:
            require(
                exception_class(name) is not None,
                "rollout_retry_on",
                f"{name!r} is not an exception class (a builtin name such as ConnectionError, or module.Class)",
            )
        require(self.max_nonfinite_steps >= 1, "max_nonfinite_steps", "must be >= 1")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.lr_decay in ("constant", "linear", "cosine"), "lr_decay", "must be constant, linear or cosine")
        require(
            self.lr_decay == "constant" or self.max_steps > 0,
            "lr_decay",
            f"{self.lr_decay!r} decay needs max_steps > 0",
        )
        require(self.weight_sync_interval >= 0, "weight_sync_interval", "must be >= 0 (0: never sync)")
        require(self.dcp_save_interval >= 0, "dcp_save_interval", "must be >= 0 (0: off)")
        require(self.dcp_keep_last >= 1, "dcp_keep_last", "must be >= 1")
        require(self.eval_interval >= 0, "eval_interval", "must be >= 0 (0: evaluate at the end only)")
        require(
            self.dcp_save_interval == 0
            or self.weight_sync_interval == 0
            or self.dcp_save_interval % self.weight_sync_interval == 0,
            "dcp_save_interval",
            f"must be a multiple of weight_sync_interval ({self.weight_sync_interval}) "
            "so a checkpoint is taken when the "
            "sampler holds the saved policy (an exact resume needs both)",
        )
        require(self.resume is None or bool(self.resume.strip()), "resume", "must be null, 'auto' or a checkpoint path")
        require(
            self.output_model_id is None or bool(self.output_model_id.strip()),
            "output_model_id",
            "must be null or a folder name",
        )
        require(self.max_head_offpolicy_versions >= 0, "max_head_offpolicy_versions", "must be >= 0 (0: on-policy)")
        require(
            self.synchronous_training or self.weight_sync_interval <= self.max_head_offpolicy_versions + 1,
            "weight_sync_interval",
            f"must be <= max_head_offpolicy_versions + 1 = {self.max_head_offpolicy_versions + 1} with the off-policy "
            "scheduler (synchronous_training=false): the gate admits rows at most that many versions ahead, so a "
            "longer sync window would wait forever for rollouts",
        )
        require(self.max_rollout_versions >= 0, "max_rollout_versions", "must be >= 0 (0: no bound)")
        if self.adapter_sync:
            require(
                self.synchronous_training or self.sampler.max_loras >= self.max_head_offpolicy_versions + 2,
                "sampler.max_loras",
                f"must be >= max_head_offpolicy_versions + 2 = {self.max_head_offpolicy_versions + 2} with adapter "
                "sync: the rollouts still running on older adapters keep them loaded",
            )
        if self.partial_rollouts:
            require(
                self.sampler.kind in ("vllm_server", "hf"),
                "partial_rollouts",
                f"needs sampler.kind=vllm_server (completions interrupted by a sync and continued) or hf "
                f"(tokens tagged by generate call); sampler.kind={self.sampler.kind} does not tag its tokens' versions",
            )
            require(
                not self.synchronous_training,
                "partial_rollouts",
                "needs synchronous_training=false: a synchronous step has no rollout in flight at a weight sync",
            )
            require(self.weight_sync_interval > 0, "partial_rollouts", "needs weight syncs (weight_sync_interval > 0)")
        copy_reason = self.why_the_sampler_copies_the_policy()
        require(
            self.sampler.share_policy_weights != "true" or copy_reason is None,
            "sampler.share_policy_weights",
            f"true needs a sampler that never generates while the policy trains, but {copy_reason}",
        )
        require(
            self.max_concurrency_rollout_sample >= self.data.completions_per_prompt,
            "max_concurrency_rollout_sample",
            f"must be >= data.completions_per_prompt ({self.data.completions_per_prompt}): rows are admitted whole",
        )
        require(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0 (0: whole batch)")
        require(self.micro_batch_max_tokens >= 0, "micro_batch_max_tokens", "must be >= 0 (0: off)")
        require(self.ppo_n_minibatches >= 1, "ppo_n_minibatches", "must be >= 1")
        batch_size = self.data.prompt_groups_per_step * self.data.completions_per_prompt
        require(
            self.ppo_n_minibatches <= batch_size,
            "ppo_n_minibatches",
            f"must be <= the sequences per step (prompt_groups_per_step × completions_per_prompt = {batch_size})",
        )
        require(
            self.rollout.overlong_buffer_len < self.sampler.max_completion_tokens,
            "rollout.overlong_buffer_len",
            f"must be < sampler.max_completion_tokens ({self.sampler.max_completion_tokens}): the penalty starts "
            f"at max_completion_tokens - overlong_buffer_len generated tokens, got {self.rollout.overlong_buffer_len}",
        )
        if self.sampler.kind == "vllm" and self.model.kind in BUILT_KINDS:
            head_dim = self.model.hidden_size // self.model.num_heads
            require(
                head_dim >= 32,
                "model.num_heads",
                f"vLLM's CPU attention needs a head size >= 32, got {head_dim}; "
                f"try model.num_heads={max(self.model.hidden_size // 32, 1)}",
            )

    @property
    def adapter_sync(self) -> bool:
        """Whether a weight sync sends only the LoRA adapter (`sampler.lora_sync`)."""
        return self.model.lora.rank > 0 and self.sampler.lora_sync_mode == "adapter"

    def why_the_sampler_copies_the_policy(self) -> Optional[str]:
        """Why the sampler needs a copy of the policy's weights (None: it can generate with the policy itself)."""
        return sampler_copy_reason(
            self.sampler.kind, self.synchronous_training, self.weight_sync_interval, self.trainer.strategy
        )

    @property
    def sampler_shares_policy_weights(self) -> bool:
        """Whether the `hf` sampler generates with the policy itself: no copy of the weights, no sync copies."""
        return self.sampler.share_policy_weights != "false" and self.why_the_sampler_copies_the_policy() is None


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
    if problems := unknown_keys(cfg, TrainConfig):  # a misspelt `+key=value`: to_object would drop it silently
        raise ConfigError(unknown_keys_message(problems))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise ConfigError("config does not follow the train schema; compose it from conf/train.yaml")
    return obj


register_configs()
