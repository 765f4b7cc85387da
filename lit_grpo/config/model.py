"""The model config group: the policy (a tiny local model or a Hugging Face one) and its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.config.checks import require, require_finite

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen2/Llama-style models."""


@dataclass
class LoraConfig:
    """LoRA training (`lit_grpo.models.lora`): only low-rank adapters train; the KL reference is the same
    model with its adapters off, and a weight sync sends the merged weights under the base names."""

    rank: int = 0
    """r of the adapters; 0: off (full fine-tuning)."""
    alpha: Optional[float] = None
    """The adapters' output is scaled by alpha / rank; null: 2·rank (a scale of 2)."""
    target_modules: Any = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Names (suffixes) of the linear layers that get adapters, or `all-linear` (every linear layer
    but the output head)."""
    dropout: float = 0.0
    """Must be 0: dropout in the adapters would make the trainer's logprobs differ from the sampler's."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.rank, int) and self.rank >= 0,
            "model.lora.rank",
            f"must be an integer >= 0 (0: off), got {self.rank!r}",
        )
        if self.alpha is not None:
            require_finite(self.alpha, "model.lora.alpha")
            require(self.alpha > 0, "model.lora.alpha", f"must be > 0 (or null: 2·rank), got {self.alpha}")
        targets = self.target_modules
        ok = targets == "all-linear" or (
            isinstance(targets, (list, tuple))
            and bool(targets)
            and all(isinstance(t, str) and t.strip() for t in targets)
        )
        require(
            ok,
            "model.lora.target_modules",
            f"must be a non-empty list of module names or 'all-linear', got {targets!r}",
        )
        require(
            self.dropout == 0,
            "model.lora.dropout",
            f"must be 0, got {self.dropout}: dropout would make the trainer's "
            "logprobs differ from the sampler's (the policy runs without dropout)",
        )

    def scale_alpha(self) -> float:
        """alpha, with null meaning 2·rank."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


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
    """Tiny model: characters of the tokenizer; `printable` (ASCII), `arithmetic` (digits, signs) or
    `lookup` (digits, keys a..h, `?=>-`: the lookup game's)."""
    init_std: Optional[float] = None
    """Tiny model: std of the random init (null: transformers' 0.02). LoRA leaves the embeddings and
    norms as initialised, and at 0.02 they cap every logit near ±1.3: no answer can be confident."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Passed to transformers when `kind=hf`."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (`lora.rank` 0: full fine-tuning)."""

    def __post_init__(self) -> None:
        require(self.kind in ("tiny", "hf"), "model.kind", f"must be 'tiny' or 'hf', got {self.kind!r}")
        require(
            self.kind != "hf" or bool(self.name_or_path),
            "model.name_or_path",
            "is required when model.kind=hf (a hub name or a local folder)",
        )
        require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", f"unknown dtype {self.dtype!r}")
        require(
            self.alphabet in ("printable", "arithmetic", "lookup"),
            "model.alphabet",
            "must be 'printable', 'arithmetic' or 'lookup'",
        )
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"model.{name}", "must be > 0")
        require(self.hidden_size % self.num_heads == 0, "model.hidden_size", "must be divisible by model.num_heads")
        require(
            self.init_std is None or 0 < self.init_std < 1,
            "model.init_std",
            f"must be null or in (0, 1), got {self.init_std}",
        )
