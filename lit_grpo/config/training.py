"""The groups of the trainer's side of a step: the optimizer (`optim.*`), how a step's batch is
cut into forwards and optimizer steps (`batching.*`), and checkpoints (`checkpoint.*`).

Each dataclass checks its own fields' ranges in `__post_init__`; the rules that tie a group to the
rest of the run are one function per group (`check_optim`, `check_batching`, `check_checkpoint`,
in `lit_grpo.config.run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_grpo.config.checks import DEFINES_STATE, require, require_finite

LR_DECAYS = ("constant", "linear", "cosine")
"""`optim.lr_decay`."""


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (the peak learning rate is the top-level `learning_rate`)."""

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

    def __post_init__(self) -> None:
        for name in ("adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "grad_clip_norm"):
            require_finite(getattr(self, name), f"optim.{name}")
        require(0 <= self.adam_beta1 < 1, "optim.adam_beta1", "must be in [0, 1)")
        require(0 <= self.adam_beta2 < 1, "optim.adam_beta2", "must be in [0, 1)")
        require(self.adam_eps > 0, "optim.adam_eps", "must be > 0")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(self.grad_clip_norm >= 0, "optim.grad_clip_norm", "must be >= 0 (0: off)")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(self.lr_decay in LR_DECAYS, "optim.lr_decay", f"must be {', '.join(LR_DECAYS)}")


@dataclass
class BatchingConfig:
    """How a step's batch is cut: into optimizer steps (PPO minibatches) and into forwards (micro-batches)."""

    micro_batch_size: int = 0
    """Sequences per forward/backward; gradients accumulate over a step (0: the whole batch)."""
    micro_batch_max_tokens: int = 0
    """Padded tokens per forward/backward (0: off, micro-batches are `micro_batch_size` rows of the
    batch padded to its longest sequence). When > 0, a step's sequences are grouped by length, each
    micro-batch cut to its own longest one, so that rows × that length stays within this budget; a
    sequence longer than the budget goes alone. With `micro_batch_size` > 0 too, both bounds apply.
    The gradient is the same either way; the memory of a forward follows the budget, not the longest sample."""
    ppo_minibatches: int = field(default=1, metadata=DEFINES_STATE)
    """K: optimizer steps per rollout batch, each on 1/K of it, all against the same old policy."""
    padding_free: bool = True
    """Pack each micro-batch's sequences into one row (position ids restarting at each sequence,
    attention kept within it, as transformers does for packed rows): no padding token is computed,
    and `micro_batch_max_tokens` counts real tokens. The same values as padded rows. Used where the
    model supports it (a transformers model with sdpa, eager, flex or flash attention; a debug line
    says why not otherwise); false: every micro-batch is padded to its longest row."""
    pack_only_where_it_pays: bool = True
    """With `padding_free`, pack a micro-batch only where the padding it saves outweighs what packing
    adds (`lit_grpo.maths.packing.PackingCost`: one attention call per sequence and layer on a CPU's
    sdpa), else pad it: a tiny model's short sequences stay padded, a real model's ragged ones are
    packed. false: pack every micro-batch."""
    share_prefixes: bool = True
    """In a packed micro-batch, compute the tokens its rows begin with in common (a group's prompt)
    once, the rows' suffixes attending to that one copy (`lit_grpo.maths.shared_prefix`, the Prefix
    Grouper layout): the same logprobs and gradients, (G - 1) × P fewer token rows per group of G
    samples of a P-token prompt (`perf/prefix_tokens_saved`). Where it pays (the rows saved against
    the attention calls it adds), and where the model runs lit_grpo's per-sequence sdpa (plain causal
    attention); false: every row whole."""
    skip_zero_advantage_rows: bool = True
    """Leave out of the step's forwards and backward the rows whose every trained token has advantage
    0 (a uniform group kept for training), where the loss gives them no gradient: a variant whose
    term is the advantage times something finite (every built-in but dro), no KL penalty
    (`policy_loss.kl_beta` 0), no entropy bonus or top-entropy mask. The loss's normalizers still
    count them, so the gradient and the update are the same (`perf/rows_skipped`); the health
    metrics (`train/entropy`, the drift) are then over the rows trained. false: every row computed."""

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 0, "batching.micro_batch_size", "must be >= 0 (0: whole batch)")
        require(self.micro_batch_max_tokens >= 0, "batching.micro_batch_max_tokens", "must be >= 0 (0: off)")
        require(self.ppo_minibatches >= 1, "batching.ppo_minibatches", "must be >= 1")


@dataclass
class CheckpointConfig:
    """Resumable checkpoints in `<output_dir>/checkpoints` (where to resume from is the top-level `resume`)."""

    save_interval: int = 0
    """Save a resumable DCP checkpoint every N rollout steps, and after the last one (0: off)."""
    keep_last: int = 2
    """Complete checkpoints kept in `<output_dir>/checkpoints` (older ones are deleted)."""

    def __post_init__(self) -> None:
        require(self.save_interval >= 0, "checkpoint.save_interval", "must be >= 0 (0: off)")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
