"""Model FLOPs of a dense decoder-only transformer: a forward, its backward, a sampler's prefill and decode.

What is counted is the matmuls, 2 FLOPs per multiply-add: in each layer the query, key, value and
output projections, the MLP (3 matrices when gated, as Llama's, Qwen2's and Gemma's; 2 when not) and
attention's `Q·Kᵀ` and `P·V`; then the LM head, only over the positions where it is computed.
Norms, rotary embeddings, softmax, activations, residual adds, biases and the embedding lookup are
elementwise or gathers (under 1% of a layer's FLOPs at any real width), not counted.

Conventions, the same in every count here:

- **Causal attention counts the causal half**: a token at position t attends to keys 0..t (t + 1
  of them), and each (query, key) pair costs 2·heads·head_dim FLOPs in `Q·Kᵀ` and as much in `P·V`.
  A sequence of T tokens has T(T+1)/2 pairs. That is what a causal flash kernel (and torch's
  `scaled_dot_product_attention` with `is_causal`) computes, up to its block granularity; an eager
  attention computes the whole T² square and masks it afterwards, so a counter of its ops (torch's
  `FlopCounterMode`) finds T² pairs. A sliding-window layer (`layer_types` "sliding_attention",
  or every layer of a Mistral with `sliding_window`) attends to at most `sliding_window` keys.
- **Tokens are spans of positions**: `(start, stop)` is positions start..stop-1 of one sequence,
  each attending to its whole causal prefix (from 0). A training forward of a sequence of L tokens
  is `(0, L)`; a sampler that prefilled a shared prompt of S tokens once runs each completion as
  `(S, L - 1)` (the last token is sampled, never fed back): prefill and decode with a KV cache do
  the same matmuls per token as one causal forward, only the LM head differs (`sampling_flops`).
- **Backward = 2 × forward** for every matmul whose weight trains (the gradient of its input and
  of its weight); a frozen weight (LoRA's base layers and LM head) needs its input's gradient only,
  1 × forward; attention has no weight and always costs 2 × forward. LoRA's own adapter matmuls
  (rank r, a fraction r/hidden of a layer's) are not counted.
- **Model FLOPs, not hardware FLOPs**: what the step needs, once. Recomputation (gradient
  checkpointing, the fused LM head's backward recomputing its logits) and padding are not
  counted: they show as a lower utilization (`perf/padding_frac` says how much padding).

`model_shape` reads a transformers config it understands (dense decoder-only models: Llama,
Mistral, Qwen2/3, Gemma 1-3, SmolLM3, OLMo, Phi, GPT-NeoX, ...), and answers `(None, why)` for
any other (a mixture of experts, a vision-language model, a family it does not know).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

GATED_MLP_TYPES = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "smollm3", "olmo", "olmo2",
        "granite", "phi3", "cohere", "helium", "glm",
    }
)  # fmt: skip
"""transformers `model_type`s of dense decoder-only models with a gated MLP (gate, up, down: 3 matrices)."""
PLAIN_MLP_TYPES = frozenset({"phi", "gpt_neox", "starcoder2"})
"""... and with a plain one (up, down: 2 matrices)."""
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

Span = tuple[int, int]
"""`(start, stop)`: positions start..stop-1 of one sequence, each attending to its causal prefix."""
SampledGroup = tuple[int, Sequence[tuple[int, int]]]
"""What a sampler computed for one group: `(shared prompt tokens, [(tokens, generated tokens) per
sample])`; shared prompt 0 when its samples' prompts differ (each is then prefilled on its own)."""


def causal_pairs(start: int, stop: int, window: int = 0) -> int:
    """(query, key) pairs of the tokens at positions start..stop-1, each attending to keys 0..t
    (`window` > 0: to the last `window` of them at most). Σ_{t=start}^{stop-1} min(t + 1, window)."""

    def upto(n: int) -> int:  # pairs of positions 0..n-1
        if window <= 0 or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return upto(max(stop, start)) - upto(start)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a dense decoder-only transformer's matmul FLOPs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key and value heads (grouped-query attention: fewer than `num_heads`)."""
    head_dim: int
    intermediate_size: int
    gated_mlp: bool
    """3 MLP matrices (gate, up, down) when True, else 2 (up, down)."""
    vocab_size: int
    sliding_window: int = 0
    """Keys a sliding-window layer attends to at most (0: none)."""
    sliding_layers: int = 0
    """How many of the layers use the sliding window."""

    @property
    def weight_flops_per_token(self) -> int:
        """Forward FLOPs of one token through every layer's weight matrices (attention scores excluded)."""
        H, d = self.hidden_size, self.head_dim
        attention = H * self.num_heads * d + 2 * H * self.num_kv_heads * d + self.num_heads * d * H
        mlp = (3 if self.gated_mlp else 2) * H * self.intermediate_size
        return 2 * self.num_layers * (attention + mlp)

    def attention_flops(self, span: Span) -> int:
        """Forward FLOPs of `Q·Kᵀ` and `P·V` in every layer for the tokens of `span` (causal half)."""
        per_pair = 2 * 2 * self.num_heads * self.head_dim  # Q·Kᵀ and P·V, 2 FLOPs per multiply-add
        full_layers = self.num_layers - self.sliding_layers
        pairs = full_layers * causal_pairs(*span)
        if self.sliding_layers:
            pairs += self.sliding_layers * causal_pairs(*span, window=self.sliding_window)
        return per_pair * pairs

    def head_flops(self, rows: int) -> int:
        """Forward FLOPs of the LM head over `rows` positions: `[rows, H] @ [H, V]`."""
        return 2 * self.hidden_size * self.vocab_size * rows


def model_shape(config: Any) -> tuple[Optional[ModelShape], str]:
    """The `ModelShape` of a transformers config, or `(None, why not)`: a model this module does not
    count (a mixture of experts, a vision-language model, a `model_type` outside `GATED_MLP_TYPES`
    and `PLAIN_MLP_TYPES`, a config without the sizes)."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is not None:
        return None, f"{model_type} is a vision-language model (its vision tower is not counted)"
    experts = [f for f in _EXPERT_FIELDS if getattr(config, f, None)]
    if experts:
        return None, f"{model_type} is a mixture of experts ({', '.join(experts)})"
    if model_type not in GATED_MLP_TYPES | PLAIN_MLP_TYPES:
        return None, f"model_type {model_type!r} is not one of the dense families counted ({_families()})"
    try:
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = int(getattr(config, "sliding_window", None) or 0)
        if layer_types:
            sliding = sum(kind == "sliding_attention" for kind in layer_types) if window else 0
        else:  # Mistral: a window, when set, applies to every layer
            sliding = int(config.num_hidden_layers) if window and model_type == "mistral" else 0
        return ModelShape(
            hidden_size=hidden,
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            gated_mlp=model_type in GATED_MLP_TYPES,
            vocab_size=int(config.vocab_size),
            sliding_window=window if sliding else 0,
            sliding_layers=sliding,
        ), ""
    except (AttributeError, TypeError, ValueError) as err:
        return None, f"its config lacks a size ({type(err).__name__}: {err})"


def _families() -> str:
    return ", ".join(sorted(GATED_MLP_TYPES | PLAIN_MLP_TYPES))


def forward_flops(shape: ModelShape, spans: Iterable[Span], head_rows: int) -> int:
    """FLOPs of a forward over `spans` (each a `(start, stop)` of one sequence's positions, attending
    to its causal prefix) with the LM head over `head_rows` of those positions."""
    total = shape.head_flops(head_rows)
    for start, stop in spans:
        if stop > start:
            total += (stop - start) * shape.weight_flops_per_token + shape.attention_flops((start, stop))
    return total


def backward_flops(shape: ModelShape, spans: Iterable[Span], head_rows: int, frozen_weights: bool = False) -> int:
    """FLOPs of the backward of `forward_flops(shape, spans, head_rows)`: 2 × its weight matmuls
    (input and weight gradients), 1 × them when the weights are frozen (LoRA: the input gradient
    only), and 2 × its attention (gradients of Q, K and V, no weight) in both cases."""
    spans = list(spans)
    weights = sum((stop - start) * shape.weight_flops_per_token for start, stop in spans if stop > start)
    weights += shape.head_flops(head_rows)
    attention = sum(shape.attention_flops(span) for span in spans if span[1] > span[0])
    return (1 if frozen_weights else 2) * weights + 2 * attention


def training_flops(
    shape: ModelShape, lengths: Iterable[int], head_rows: int, frozen_weights: bool = False
) -> tuple[int, int]:
    """(forward, backward) FLOPs of training on whole sequences of `lengths` tokens, the LM head over
    `head_rows` positions in all. Shapes: lengths `[B]`."""
    spans = [(0, n) for n in lengths]
    return forward_flops(shape, spans, head_rows), backward_flops(shape, spans, head_rows, frozen_weights)


def sampling_flops(shape: ModelShape, groups: Iterable[SampledGroup]) -> int:
    """FLOPs a sampler spent on `groups`: a group whose samples share a prompt of P tokens prefills
    P - 1 of them once (as the `hf` sampler's shared prefill does; vLLM's prefix cache shares at
    least as much), then each sample runs its own positions P-1 .. L-2 against that KV cache
    (its last token is sampled, never fed back); without a shared prompt each sample runs
    positions 0 .. L-2. The LM head runs once per generated token (each from the position before it).
    """
    total = 0
    for shared, samples in groups:
        prefix = max(shared - 1, 0)
        spans = [(0, prefix)] if prefix else []
        spans += [(prefix, max(length - 1, prefix)) for length, _ in samples]
        total += forward_flops(shape, spans, sum(generated for _, generated in samples))
    return total
