"""The model config group: the policy (a model built here, tiny or of a real model's shapes, or a Hugging
Face one) and its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.config.checks import require, require_finite

MIN_BYTE_BPE_VOCAB = 8 + 256
"""The smallest `vocab_size` of `kind=qwen2_shape`: its 8 special tokens and the 256 bytes
(`lit_grpo.models.byte_bpe`)."""

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen2/Llama-style models."""


@dataclass
class LoraConfig:
    """LoRA training (`lit_grpo.models.lora`): only low-rank adapters train; the KL reference is the same
    model with its adapters off, and a weight sync sends the adapters alone or the merged weights under
    the base names (`sampler.lora_sync`)."""

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


MODEL_KINDS = ("tiny", "qwen2_shape", "tiny_vlm", "hf")
TINY_VLM_ARCHS = ("qwen2_vl", "idefics3")
"""`model.vlm_arch`: the tiny VLMs `lit_grpo.models.vision` builds."""
BUILT_KINDS = ("tiny", "qwen2_shape", "tiny_vlm")
"""The kinds built here from the fields below, random-init and seeded (no download)."""
TEXT_BUILT_KINDS = ("tiny", "qwen2_shape")
"""The built kinds that are text policies: they take no images (`tiny_vlm` does; `hf` is known once loaded)."""


@dataclass
class ModelConfig:
    """The policy model. `kind=tiny` and `kind=qwen2_shape` build a random-init Qwen2 here; `kind=hf` loads one."""

    kind: str = "tiny"
    """`tiny` (a small Qwen2 with a character tokenizer), `qwen2_shape` (a Qwen2 of any shapes, e.g. a
    real model's, with a byte-level BPE tokenizer of `vocab_size` ids: `conf/model/rehearsal_0p5b.yaml`),
    both built from the fields below with no download; `tiny_vlm` (a tiny Qwen2-VL: a one-block vision
    tower and a text model of `hidden_size` and `num_layers`, a character tokenizer with Qwen2-VL's
    special tokens and its processor, `lit_grpo.models.vision`); or `hf` (`AutoModelForCausalLM`)."""
    name_or_path: Optional[str] = None
    """Hub name or local folder of the model and tokenizer when `kind=hf`."""
    hidden_size: int = 64
    """Built model: width of the residual stream."""
    num_layers: int = 2
    """Built model: number of decoder layers."""
    num_heads: int = 4
    """Built model: attention (query) heads."""
    num_kv_heads: Optional[int] = None
    """Built model: key/value heads (grouped-query attention; must divide `num_heads`); null: `num_heads`."""
    intermediate_size: int = 256
    """Built model: MLP width."""
    max_position_embeddings: int = 256
    """Built model: longest sequence it can read."""
    vocab_size: Optional[int] = None
    """`kind=qwen2_shape`: ids of the model and its tokenizer (byte-level BPE merges, then filler
    tokens up to this size, `lit_grpo.models.byte_bpe`); must be null for `tiny`, whose vocabulary is
    its alphabet's."""
    rope_theta: float = 10000.0
    """Built model: the base of the rotary position embeddings."""
    rms_norm_eps: float = 1e-6
    """Built model: epsilon of the RMS norms."""
    alphabet: str = "printable"
    """Tiny model: characters of the tokenizer; `printable` (ASCII), `arithmetic` (digits, signs),
    `lookup` (digits, keys a..h, `?=>-`: the lookup game's) or `calculator` (arithmetic and the JSON
    of tool calls: the calculator task's)."""
    init_std: Optional[float] = None
    """Built model: std of the random init (null: transformers' 0.02). LoRA leaves the embeddings and
    norms as initialised, and at 0.02 they cap every logit near ±1.3: no answer can be confident."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Passed to transformers when `kind=hf`."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (`lora.rank` 0: full fine-tuning)."""
    gradient_checkpointing: Optional[bool] = None
    """Recompute each decoder layer's activations in the backward instead of keeping them (non-reentrant,
    per layer, under DDP, FSDP2 and LoRA alike: `lit_grpo.models.checkpointing`): a step's activation
    memory drops to about one layer's, for about a third more compute. Only the training forward pays;
    the reference and old-policy forwards and sampling do not. null (auto): on when the policy's
    `hidden_size × num_layers` is at least 16,384 (Qwen2.5-0.5B: 21,504; the tiny demo's 128 stays off)."""
    vlm_arch: str = "qwen2_vl"
    """`kind=tiny_vlm`: its architecture, `qwen2_vl` (Qwen2-VL) or `idefics3` (the SmolVLM family:
    the one vLLM 0.32's CPU build runs without torchvision, so `sampler=vllm` takes it on a CPU)."""
    train_vision: bool = False
    """A vision-language policy (`kind=tiny_vlm`, or a VLM folder with `kind=hf`): train its vision
    tower too; false: the tower is frozen and only the language model trains."""
    fused_lm_head: bool = True
    """Apply the LM head a chunk of tokens at a time in the trainer's forwards (policy, reference,
    old policy), straight into logprobs, recomputed in the backward: no `[rows, T, V]` logits.
    Used for any model whose head is a plain linear layer (not a LoRA-wrapped one, not FSDP2-sharded);
    false: the model's full logits (`guides/long-sequences.md`)."""

    def __post_init__(self) -> None:
        require(self.kind in MODEL_KINDS, "model.kind", f"must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}")
        require(
            self.vlm_arch in TINY_VLM_ARCHS,
            "model.vlm_arch",
            f"must be one of {', '.join(TINY_VLM_ARCHS)}, got {self.vlm_arch!r}",
        )
        require(
            self.kind != "hf" or bool(self.name_or_path),
            "model.name_or_path",
            "is required when model.kind=hf (a hub name or a local folder)",
        )
        require(
            self.gradient_checkpointing is None or isinstance(self.gradient_checkpointing, bool),
            "model.gradient_checkpointing",
            f"must be true, false or null (auto), got {self.gradient_checkpointing!r}",
        )
        require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", f"unknown dtype {self.dtype!r}")
        require(
            self.alphabet in ("printable", "arithmetic", "lookup", "calculator"),
            "model.alphabet",
            "must be 'printable', 'arithmetic', 'lookup' or 'calculator'",
        )
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"model.{name}", f"must be > 0, got {getattr(self, name)}")
        require(self.hidden_size % self.num_heads == 0, "model.hidden_size", "must be divisible by model.num_heads")
        if self.num_kv_heads is not None:
            require(
                isinstance(self.num_kv_heads, int)
                and self.num_kv_heads > 0
                and self.num_heads % self.num_kv_heads == 0,
                "model.num_kv_heads",
                f"must be null or an integer > 0 dividing model.num_heads={self.num_heads}, got {self.num_kv_heads!r}",
            )
        require(
            self.init_std is None or 0 < self.init_std < 1,
            "model.init_std",
            f"must be null or in (0, 1), got {self.init_std}",
        )
        for name in ("rope_theta", "rms_norm_eps"):
            require_finite(getattr(self, name), f"model.{name}")
            require(getattr(self, name) > 0, f"model.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.kind == "qwen2_shape":
            require(
                isinstance(self.vocab_size, int) and self.vocab_size >= MIN_BYTE_BPE_VOCAB,
                "model.vocab_size",
                f"must be an integer >= {MIN_BYTE_BPE_VOCAB} (8 special tokens + 256 bytes) with "
                f"model.kind=qwen2_shape, got {self.vocab_size!r}",
            )
        else:
            require(
                self.vocab_size is None,
                "model.vocab_size",
                f"must be null with model.kind={self.kind} (only model.kind=qwen2_shape is sized by it)",
            )
