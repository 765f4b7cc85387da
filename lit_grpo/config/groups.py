"""The config groups' dataclasses: data, rollout, reward, advantage, policy loss (the model's in
`lit_grpo.config.model`, the sampler's in `lit_grpo.config.sampler`, the trainer's in
`lit_grpo.config.trainer`, the shared checks in `lit_grpo.config.checks`); `lit_grpo.config.run`
composes them into `TrainConfig`.

Every field has a docstring, and `__post_init__` checks what one group can check alone, naming
the field (`lit_grpo.config.run.check_rollout`: the rollout group's rules with the rest of the
run); `ConfigError` is what a user sees.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.config.checks import (
    DEFINES_STATE,
    require,
    require_finite,
)


@dataclass
class DataConfig:
    """Where the rows come from (`path`: a file or dataset of your own; null: the task's rows) and
    how they are grouped into steps. Rows reach the rollout exactly as stored (`lit_grpo.tasks.rows`)."""

    path: Optional[str] = field(default=None, metadata=DEFINES_STATE)
    """Training rows: a `.jsonl`, `.json` (a list of objects), `.parquet` or `.csv` file, or a
    Hugging Face dataset name or local dataset folder (Parquet, CSV and datasets need the
    `lit_grpo[datasets]` extra); null: the task's rows. Rows given to `build_run(c, rows=...)` come first."""
    split: str = field(default="train", metadata=DEFINES_STATE)
    """The split of a dataset `path` trained on."""
    dataset_config: Optional[str] = field(default=None, metadata=DEFINES_STATE)
    """The config name of a dataset `path` or `eval_path` (e.g. `main` for openai/gsm8k)."""
    eval_path: Optional[str] = None
    """Held-out rows (the first `eval_rows` of them are evaluated), in any form `path` takes;
    null: the task's held-out rows (needed when `path` is set and `eval_rows` > 0)."""
    eval_split: str = "test"
    """The split of a dataset `eval_path` evaluated on."""
    prompt_field: Optional[str] = None
    """The row field the default rollout takes the prompt from: text (tokenized with the
    tokenizer's special tokens), chat messages (through the chat template) or token ids. null: the
    first of `prompt_token_ids`, `messages`, `prompt` that a row has."""

    completions_per_prompt: int = field(default=8, metadata=DEFINES_STATE)
    """G: completions sampled per prompt; advantages are relative within these."""
    prompt_groups_per_step: int = field(default=8, metadata=DEFINES_STATE)
    """P: accepted prompt groups per training step (B = P·G sequences)."""
    max_rows: int = field(default=0, metadata=DEFINES_STATE)
    """Use at most this many training rows, wherever they come from (0: all)."""
    epochs: int = 1
    """Passes over the rows; rows are reshuffled each epoch with the run seed."""
    max_seq_len: int = 64
    """Longest prompt + completion, in tokens."""
    shuffle: bool = field(default=True, metadata=DEFINES_STATE)
    """Shuffle rows each epoch (seeded)."""
    min_group_size: int = 2
    """A group left with fewer samples (after dropped or failed rollouts) is dropped."""
    eval_rows: int = 0
    """Held-out rows (of `eval_path`, or the task's) scored greedily for `eval/accuracy` (0: no evaluation)."""

    def __post_init__(self) -> None:
        for name in ("path", "eval_path", "prompt_field", "dataset_config"):
            value = getattr(self, name)
            require(value is None or bool(value.strip()), f"data.{name}", "must be null or a non-empty string")
        for name in ("split", "eval_split"):
            require(bool(getattr(self, name).strip()), f"data.{name}", "must be a split name, e.g. train or test")
        require(self.eval_rows >= 0, "data.eval_rows", "must be >= 0 (0: no evaluation)")
        require(
            not (self.path and not self.eval_path and self.eval_rows > 0),
            "data.eval_path",
            f"is needed with data.path={self.path} when data.eval_rows > 0 (held-out rows of your own), "
            "or set data.eval_rows=0",
        )
        require(
            self.completions_per_prompt >= 2,
            "data.completions_per_prompt",
            "must be >= 2 (advantages are relative within a group)",
        )
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
    """The rollout function (the user's extension point), and the length controls applied to what
    every rollout function returns (`lit_grpo.rollouts.pipeline`)."""

    factory: str = "lit_grpo.rollouts.rollout:make_rollout_fn"
    """`module:function` of a `make_rollout_fn(setup) -> rollout_fn`, importable from the working directory."""
    extras: dict = field(default_factory=dict)
    """Anything the factory needs, handed over as `setup.extras` (next to `reward_fn`)."""
    mask_truncated: bool = False
    """Zero the loss mask of every sequence whose `finish_reason` is `length` (DAPO's overlong
    filtering). They still count in their group's rewards and advantages, as sampled (as TRL's
    `mask_truncated_completions`); `rollout/truncated_masked_frac` logs the share masked."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong penalty (0: off): a run of L generated tokens (its segments' loss-masked
    tokens) gets `min(0, (L_max - buffer - L) / buffer) * overlong_penalty_factor` added to its reward,
    at most `-factor`, where L_max is `sampler.max_completion_tokens`; logged as `reward/overlong_penalty`."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at L >= L_max (taken negative): `-overlong_penalty_factor`."""
    max_concurrency: int = 256
    """Most rollout calls in flight at once (asynchronous mode)."""

    def __post_init__(self) -> None:
        require(":" in self.factory, "rollout.factory", f"must be 'module:function', got {self.factory!r}")
        require(
            self.overlong_buffer_len >= 0,
            "rollout.overlong_buffer_len",
            f"must be >= 0 (0: no overlong penalty), got {self.overlong_buffer_len}",
        )
        require_finite(self.overlong_penalty_factor, "rollout.overlong_penalty_factor")
        require(
            self.overlong_penalty_factor >= 0,
            "rollout.overlong_penalty_factor",
            f"must be >= 0 (the penalty is subtracted), got {self.overlong_penalty_factor}",
        )
        require(self.max_concurrency >= 1, "rollout.max_concurrency", f"must be >= 1, got {self.max_concurrency}")


REWARD_MODEL = "reward_model"
"""The component of `reward.fn` that is the reward model (`reward.model`)."""


@dataclass
class RewardConfig:
    """The reward (`lit_grpo.rewards`): the task's own, or functions of your own, weighted."""

    fn: Any = None
    """null: the task's reward (the reward model's when `model` is set). Or a registered reward
    (`arithmetic`, `gsm8k`, `exact_match`), `reward_model` (the reward model of `model`), or
    `module:function` of your own (imported from the working directory), or a list of them: their
    weighted sum, each component also logged as `reward/<name>`. A reward is
    `reward(completion_text, row) -> float | None` (None: not applicable to this row)."""
    weights: Optional[list[float]] = None
    """One weight per component of `fn` (null: all 1.0)."""
    max_concurrency: int = 64
    """Most reward components running at once (an `async def` judge's requests in flight, plain
    functions on worker threads), per event loop."""
    timeout_s: float = 60.0
    """Deadline of one component's call, the wait for a slot included; past it the component
    scores `timeout_reward` and the sample counts in `reward/timed_out` (the first is logged, the
    total at the end of the run)."""
    timeout_reward: float = 0.0
    """The value of a component that missed its deadline."""
    max_timeout_share: float = 0.5
    """The run stops (its last finished step kept) once more than this share of the last 64 samples
    scored `timeout_reward` in place of their reward: the reward is down or far too slow. 1.0: never."""
    model: Optional[str] = None
    """A reward model scoring (prompt, completion), a local folder or a hub name loaded with
    `AutoModelForSequenceClassification` and its own tokenizer (one output, `num_labels=1`: its
    logit is the reward), in the trainer's process, never trained. It is the component
    `reward_model` of `fn` (null `fn`: the reward model alone). null: none."""
    model_batch_size: int = 32
    """Most (prompt, completion) pairs the reward model scores in one forward; concurrent requests
    are gathered into a batch (also bounded by `max_concurrency`, the requests in flight)."""
    model_linger_s: float = 0.01
    """How long the first request of a batch waits for others before the forward runs anyway."""
    model_device: str = "auto"
    """The reward model's device: `cpu`, `cuda`, `cuda:N`, or `auto` (this rank's GPU when there is
    one, else the CPU)."""
    model_dtype: str = "float32"
    """The reward model's parameter dtype: float32, bfloat16 or float16."""
    model_url: Optional[str] = None
    """A vLLM server of `model` (`python -m lit_grpo.serve --model <model> --runner pooling --convert
    classify`): batches go to its `/classify`, formatted here by `model`'s tokenizer (only the
    tokenizer loads here). null: the model runs in the trainer's process."""
    model_api_key_env: str = "LIT_GRPO_SERVER_KEY"
    """With `model_url`: the environment variable holding the server's key, sent on every request
    (unset or empty: none is sent). The config names where the key is, never the key."""
    model_request_timeout_s: float = 30.0
    """With `model_url`: deadline of one request to the server; past it (or on a refused connection,
    a reset or a 5xx) the call is a `ConnectionError`, retried as `guards.rollout_retry_on` says."""

    def specs(self) -> list[str]:
        """`fn` as a list of names (empty when null); with a reward model and a null `fn`, the
        reward model alone."""
        if self.fn is None:
            return [REWARD_MODEL] if self.model is not None else []
        return list(self.fn) if isinstance(self.fn, (list, tuple)) else [self.fn]

    def __post_init__(self) -> None:  # the names are checked against the reward registry in lit_grpo.run.validate
        specs = self.specs()
        require(
            self.fn is None or bool(specs), "reward.fn", "must name at least one reward, or be null (the task's reward)"
        )
        for spec in specs:
            require(
                isinstance(spec, str) and bool(spec.strip()),
                "reward.fn",
                f"must be reward names or 'module:function', got {spec!r}",
            )
        require(self.max_concurrency >= 1, "reward.max_concurrency", f"must be >= 1, got {self.max_concurrency}")
        require_finite(self.timeout_s, "reward.timeout_s")
        require(self.timeout_s > 0, "reward.timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        require_finite(self.timeout_reward, "reward.timeout_reward")
        require(
            0 < self.max_timeout_share <= 1,
            "reward.max_timeout_share",
            f"must be in (0, 1] (1.0: never stop), got {self.max_timeout_share}",
        )
        self._check_model(specs)

    def _check_model(self, specs: list[str]) -> None:
        require(
            self.model is None or (isinstance(self.model, str) and bool(self.model.strip())),
            "reward.model",
            "must be null or a reward model's folder or hub name",
        )
        named = REWARD_MODEL in specs
        require(
            not named or self.model is not None,
            "reward.fn",
            f"names {REWARD_MODEL!r}, the reward model, but reward.model is null; set reward.model=/path/to/model",
        )
        require(
            named or self.model is None,
            "reward.model",
            f"is set, but reward.fn={self.fn} does not name its component {REWARD_MODEL!r}; add it, e.g. "
            f"reward.fn=[{specs[0] if specs else 'gsm8k'},{REWARD_MODEL}], or leave reward.fn null (the reward "
            "model alone)",
        )
        require(self.model_batch_size >= 1, "reward.model_batch_size", f"must be >= 1, got {self.model_batch_size}")
        require_finite(self.model_linger_s, "reward.model_linger_s")
        require(self.model_linger_s >= 0, "reward.model_linger_s", f"must be >= 0 seconds, got {self.model_linger_s}")
        require(
            self.model_dtype in ("float32", "bfloat16", "float16"),
            "reward.model_dtype",
            f"must be float32, bfloat16 or float16, got {self.model_dtype!r}",
        )
        require(
            self.model_url is None or self.model is not None,
            "reward.model_url",
            "needs reward.model too: the served model's folder or hub name, whose tokenizer formats its input here",
        )
        require(
            self.model_url is None or re.match(r"https?://[^/\s]+", str(self.model_url)) is not None,
            "reward.model_url",
            f"must be http://host:port or https://..., got {self.model_url!r}",
        )
        require(
            re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(self.model_api_key_env)) is not None,
            "reward.model_api_key_env",
            "must name an environment variable (the key itself never goes in the config), "
            f"got {self.model_api_key_env!r}",
        )
        require_finite(self.model_request_timeout_s, "reward.model_request_timeout_s")
        require(
            self.model_request_timeout_s > 0,
            "reward.model_request_timeout_s",
            f"must be > 0 seconds, got {self.model_request_timeout_s}",
        )
        require(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", str(self.model_device)) is not None,
            "reward.model_device",
            f"must be auto, cpu, cuda, cuda:N or mps, got {self.model_device!r}",
        )


@dataclass
class AdvantageConfig:
    """How a group's rewards become advantages (`advantage=<name>`, `conf/advantage/<name>.yaml`).

    `name` is a registered estimator (`lit_grpo.advantages.registry`: grpo, dr_grpo, rloo, batch_std,
    reinforce_pp, passk, gdpo, igpo) or
    `module.path:name` for a user's (its module's `@register_advantage("name")` registers it);
    `params` its hyper-parameters, checked against the registry in `lit_grpo.run.validate`.
    """

    name: str = "grpo"
    """grpo: (r - mean) / (std + eps); dr_grpo: r - mean; rloo: r - mean of the others; batch_std:
    group mean, batch std; reinforce_pp: group-centred, divided by the batch std of that; passk:
    pass@k of binary rewards; gdpo: reward.fn's components z-scored apart, weighted, z-scored again;
    igpo: IGPO's per-token turn credit."""
    params: dict = field(default_factory=dict)
    """The estimator's hyper-parameters by their registered names (grpo, batch_std, reinforce_pp:
    eps; passk: k; gdpo: weights, eps; igpo: gamma, skip_last_ig, eps); unset or null ones take the
    registered default."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(self.name.strip()), "advantage.name", "must name a registered advantage"
        )
        self.params = {k: v for k, v in self.params.items() if v is not None}  # null: unset (an experiment's undo)


ANCHORS = ("old_policy", "rollout")
"""`policy_loss.anchor_logp`: the trainer's logprobs before the update, or the sampler's."""


@dataclass
class PolicyLossConfig:
    """The policy objective; `conf/policy_loss/<name>.yaml` holds each built-in variant's defaults.

    A variant's own hyper-parameters (`eps_clip`, `dro_beta`, ...) live in `params` only, where
    validation checks each against the loss registry (its name, type and bounds), so one the
    variant does not take is an error naming it, not a silent no-op.
    """

    name: str = field(default="grpo", metadata=DEFINES_STATE)
    """A registered variant (`lit_grpo.maths.losses`: grpo, importance_sampling, reinforce, dapo, dro,
    gspo, luspo, cispo, sapo, gmpo, dppo, vespo), or `module.path:name` for a user's loss: `module.path` is imported
    first (the working directory is importable) and its `@register_policy_loss("name")` registers it."""
    kl_beta: float = 0.001
    """β of the k3 KL penalty to the frozen reference (every variant takes it); > 0 builds the reference model."""
    loss_normalization: str = "token_mean"
    """A registered normalization (`lit_grpo.maths.loss_terms.LOSS_NORMALIZATIONS`): token_mean (over
    the whole optimizer step), seq_mean or sum."""
    anchor_logp: str = "old_policy"
    """What the loss's ratio is anchored on ("old"): `old_policy`, the trainer's logprobs before
    this batch's first update (a no-gradient forward when batching.ppo_minibatches > 1); or `rollout`, the
    sampler's logprobs, which skips that forward and makes the mismatch correction an identity
    (the cookbook's `anchor_logp`, verl's bypass mode)."""
    params: dict = field(default_factory=dict)
    """The variant's own hyper-parameters by their registered names (grpo, gspo, luspo, cispo, gmpo:
    eps_clip, eps_clip_high; dapo: those and eps_clip_c; dro: dro_beta; sapo: sapo_tau_pos,
    sapo_tau_neg; dppo: dppo_divergence, dppo_tv_threshold, dppo_kl_threshold, dppo_ratio_cap;
    vespo: vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg; a user's: what it was
    registered with, `+policy_loss.params.scale=3.0`); unset or null ones take the registered default."""

    def __post_init__(
        self,
    ) -> None:  # the name and `params` are checked against the loss registry in lit_grpo.run.validate
        require_finite(self.kl_beta, "policy_loss.kl_beta")
        require(self.kl_beta >= 0, "policy_loss.kl_beta", f"must be >= 0, got {self.kl_beta}")
        require(
            self.anchor_logp in ANCHORS,
            "policy_loss.anchor_logp",
            f"must be one of {', '.join(ANCHORS)}, got {self.anchor_logp!r}",
        )
        require("kl_beta" not in self.params, "policy_loss.params.kl_beta", "set it as policy_loss.kl_beta")
        self.params = {k: v for k, v in self.params.items() if v is not None}  # null: unset (an experiment's undo)

    def hyperparams(self) -> dict[str, Any]:
        """The hyper-parameters to call the loss with: `params` and kl_beta."""
        return {**self.params, "kl_beta": self.kl_beta}
