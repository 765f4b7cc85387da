"""The fused LM head: selected-token logprobs and entropy from the final hidden states, no `[N, V]` logits.

`selected_logprobs_and_entropy` (`lit_grpo.maths.logprobs`) starts from logits the model already
made: `[B, K, V]` of them, plus their gradient, each 2.5 GB in float32 for 8 × 512 tokens of a
151,936-id vocabulary. Here the LM head itself is applied a chunk of tokens at a time:

- forward: each chunk's logits `hidden_C @ weight.T (+ bias)` (in the head's dtype, as
  `nn.Linear` computes them) become the chunk's logprobs, entropy and two float32 statistics per
  row (max and log-sum-exp), then are freed; only the hidden states, the head's weight (both
  alive anyway) and the statistics are saved;
- backward: each chunk's logits are recomputed, turned into their gradient (`chunk_grad`, the
  same formula as the unfused path), and that gradient, in the head's dtype like autograd's
  through `nn.Linear`, gives the chunk's rows of the hidden states' gradient and a share of the
  weight's (and bias's), accumulated in float32.
- one chunk: where every row fits in one chunk, the forward keeps that chunk's log-softmax for the
  backward (`log_softmax_grad`), which then runs three matmuls instead of four (no recomputed
  logits). The backward would allocate that chunk again to recompute it, so the peak is the same.

At most a few `[C, V]` chunks exist at once (C = `chunk_rows`), forward or backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from lit_grpo.maths.softmax_chunks import chunk_forward, chunk_grad, default_chunk_rows, log_softmax_grad

# Bytes of one float32 `[rows, V]` chunk (441 rows of Qwen2.5's 151,936 ids). Each chunk feeds the
# head's matmuls, whose speed depends on the rows: on a 2-core CPU a `[C, 896] x [896, 151,936]`
# matmul ran at 114 GFLOP/s with 110 rows, 174 with 256 and 181 with 512, and the head's forward
# and backward over 2,048 tokens took 14.9 s in 110-row chunks against 12.0-12.6 s in 384-768-row
# ones. A few such chunks (two in the forward, up to two in the backward) are the head's footprint.
FUSED_CHUNK_BYTES = 256 * 2**20


def _compute_dtype(hidden_NH: torch.Tensor, weight_VH: torch.Tensor) -> torch.dtype:
    """The dtype `nn.Linear` would compute the logits in here: autocast's when it is on (mixed
    precision), else the weight's. Recorded in the forward, since the backward runs without autocast."""
    device_type = hidden_NH.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_VH.dtype


def _in_dtype(
    weight_VH: torch.Tensor, bias_V: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias cast once per pass (no copy when already of `dtype`), as autocast casts them."""
    return weight_VH.to(dtype), None if bias_V is None else bias_V.to(dtype)


def _scaled_chunk_logits(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    start: int,
    stop: int,
    temperature: float,
    out_CV: torch.Tensor,
) -> tuple[torch.Tensor, torch.dtype]:
    """`linear(hidden[start:stop], weight, bias).float() / temperature` in (a `[C, V]` view of) the
    float32 scratch `out_CV`, and the dtype the logits were computed in (the weight's, which
    `_in_dtype` has set to the compute dtype). A float32 head writes its matmul straight into the
    scratch (no logits-sized temporary); a half one makes its logits in its dtype, as `nn.Linear`
    does, then copies them. Shapes: `[N, H]`, `[V, H]`, `[V]` -> `[C, V]` float32.
    """
    chunk_CV = out_CV[: stop - start]
    hidden_CH = hidden_NH[start:stop].to(weight_VH.dtype)
    with torch.autocast(hidden_NH.device.type, enabled=False):  # the dtype is chosen by `_compute_dtype`
        if weight_VH.dtype != torch.float32:
            chunk_CV.copy_(torch.nn.functional.linear(hidden_CH, weight_VH, bias_V))
        elif bias_V is None:  # the ops `nn.Linear` runs: mm without a bias, addmm with one
            torch.mm(hidden_CH, weight_VH.T, out=chunk_CV)
        else:
            torch.addmm(bias_V, hidden_CH, weight_VH.T, out=chunk_CV)
    # Divide (not multiply by 1/temperature) to round exactly as the naive `logits / temperature`.
    return (chunk_CV.div_(temperature) if temperature != 1.0 else chunk_CV), weight_VH.dtype


class _HeadLogprobs(torch.autograd.Function):
    """Autograd for `head_logprobs_and_entropy`; saves the hidden states and the head, never logits."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_N: torch.Tensor,
        temperature: float,
        chunk_rows: int,
        entropy_grad: bool,
    ):
        n_rows, V = hidden_NH.shape[0], weight_VH.shape[0]
        device = hidden_NH.device
        ctx.compute_dtype = _compute_dtype(hidden_NH, weight_VH)
        head_VH, head_bias_V = _in_dtype(weight_VH, bias_V, ctx.compute_dtype)
        selected_N, entropy_N, row_max_N, log_sum_exp_N = torch.empty(4, n_rows, dtype=torch.float32, device=device)
        scaled_CV = torch.empty(min(chunk_rows, n_rows), V, dtype=torch.float32, device=device)
        work_CV = torch.empty_like(scaled_CV)
        for start in range(0, n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            rows = slice(start, stop)
            chunk_CV, _ = _scaled_chunk_logits(hidden_NH, head_VH, head_bias_V, start, stop, temperature, scaled_CV)
            selected_N[rows], entropy_N[rows], row_max_N[rows], log_sum_exp_N[rows] = chunk_forward(
                chunk_CV, targets_N[rows], work_CV[: stop - start]
            )
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, targets_N, row_max_N, log_sum_exp_N, entropy_N)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        # One chunk: its log-softmax (what `chunk_forward` left in the scratch) is the backward's, kept.
        ctx.kept_logp_NV = scaled_CV if n_rows <= chunk_rows and any(ctx.needs_input_grad[:3]) else None
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy_N)
        return selected_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_selected_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None):
        nothing = (None,) * 7
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        if (grad_selected_N is None and grad_entropy_N is None) or not (wants_hidden or wants_weight or wants_bias):
            return nothing
        hidden_NH, weight_VH, bias_V, targets_N, row_max_N, log_sum_exp_N, entropy_N = ctx.saved_tensors
        n_rows, V = hidden_NH.shape[0], weight_VH.shape[0]
        device, chunk_rows = hidden_NH.device, ctx.chunk_rows
        grad_N = grad_selected_N.float() if grad_selected_N is not None else torch.zeros(n_rows, device=device)
        grad_H_N = None if grad_entropy_N is None else grad_entropy_N.float()
        grad_hidden_NH = torch.empty(hidden_NH.shape, dtype=hidden_NH.dtype, device=device) if wants_hidden else None
        # Summed over every chunk: float32, so a half-precision head's gradient is rounded once, at the end.
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=device) if wants_weight else None
        grad_bias_V = torch.zeros(V, dtype=torch.float32, device=device) if wants_bias else None
        head_VH, head_bias_V = _in_dtype(weight_VH, bias_V, ctx.compute_dtype)
        scaled_CV = torch.empty(
            0 if ctx.kept_logp_NV is not None else min(chunk_rows, n_rows), V, dtype=torch.float32, device=device
        )
        work_CV = torch.empty(min(chunk_rows, n_rows), V, device=device) if grad_H_N is not None else None
        kept_logp_NV, ctx.kept_logp_NV = ctx.kept_logp_NV, None  # used once: a second backward recomputes
        for start in range(0, n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            rows = slice(start, stop)
            entropy_grad = None
            if grad_H_N is not None and work_CV is not None:
                entropy_grad = (grad_H_N[rows], entropy_N[rows], work_CV[: stop - start])
            if kept_logp_NV is not None:
                logits_dtype = head_VH.dtype
                grad_float_CV = log_softmax_grad(kept_logp_NV, targets_N, grad_N, ctx.temperature, entropy_grad)
            else:
                chunk_CV, logits_dtype = _scaled_chunk_logits(
                    hidden_NH, head_VH, head_bias_V, start, stop, ctx.temperature, scaled_CV
                )
                grad_float_CV = chunk_grad(
                    chunk_CV, targets_N[rows], row_max_N[rows], log_sum_exp_N[rows], grad_N[rows], ctx.temperature,
                    entropy_grad,
                )  # fmt: skip
            # The logits' gradient in their dtype, as autograd's through `.float()` and `nn.Linear`.
            grad_logits_CV = grad_float_CV.to(logits_dtype)
            if grad_hidden_NH is not None:
                grad_hidden_NH[rows] = grad_logits_CV @ head_VH
            if grad_weight_VH is None:
                pass
            elif logits_dtype == torch.float32:
                grad_weight_VH.addmm_(grad_logits_CV.T, hidden_NH[rows].float())
            else:  # a half-precision matmul (as autograd's), summed in float32
                grad_weight_VH.add_(grad_logits_CV.T @ hidden_NH[rows].to(logits_dtype))
            if grad_bias_V is not None:
                grad_bias_V.add_(grad_logits_CV.sum(0))
        grad_weight = None if grad_weight_VH is None else grad_weight_VH.to(weight_VH.dtype)
        grad_bias = None if grad_bias_V is None else grad_bias_V.to(bias_V.dtype)
        return grad_hidden_NH, grad_weight, grad_bias, None, None, None, None


def head_logprobs_and_entropy(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target token and the entropy of each row's tempered distribution, through the LM head.

    Equals `selected_logprobs_and_entropy(linear(hidden, weight, bias), targets, temperature)`, i.e.
    `log_softmax(logits.float() / temperature).gather(target)` and `-(p * log p).sum(-1)`, with
    gradients to the hidden states, the weight and the bias (those that require one) for the
    logprob, and for the entropy too with `entropy_grad`; else the entropy is detached. The logits
    exist `chunk_rows` rows at a time only (`None`: a ~256 MiB float32 chunk, `FUSED_CHUNK_BYTES`).
    A tied head (the weight is the input embedding) needs nothing special: the weight's gradient
    is returned to autograd, which adds it to the parameter's like any other use of it.

    Shapes: hidden `[N, H]`, weight `[V, H]`, bias `[V]` or None (all of one float dtype),
    targets `[N]` (valid ids) -> (`[N]` float32, `[N]` float32).
    """
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden_NH.shape)} and {tuple(weight_VH.shape)}"
        )
    if targets_N.shape != hidden_NH.shape[:1]:
        raise ValueError(f"targets [N] expected for hidden {tuple(hidden_NH.shape)}, got {tuple(targets_N.shape)}")
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(weight_VH.shape[0], FUSED_CHUNK_BYTES)
    if rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {rows}")
    if hidden_NH.shape[0] == 0:  # no prediction to make: empty outputs still carry the graph
        empty_N = hidden_NH.sum(-1).float() * 0
        return empty_N, empty_N.detach()
    return _HeadLogprobs.apply(hidden_NH, weight_VH, bias_V, targets_N.long(), float(temperature), rows, entropy_grad)


# Config fields of models whose logits are more than `lm_head(hidden)` (Gemma 2's soft cap, Cohere's
# and Granite's scales): their heads are not fused, the model's own forward stays exact for them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True)
class LMHeadSplit:
    """A causal LM cut before its LM head: the body makes the final hidden states, the head is applied by us."""

    body: Callable[..., torch.Tensor]
    """`(input_ids [B, T], attention_mask [B, T] or None, position_ids [B, T] or None, **attention
    kwargs) -> last hidden states [B, T, H]` (final norm included); position ids and no mask: packed
    sequences, with `maths.packing.packed_forward`'s keyword arguments."""
    head: torch.nn.Linear
    """The output embedding (`get_output_embeddings()`): weight `[V, H]`, tied to the input one or not."""


def _decoder_body(decoder: torch.nn.Module) -> Callable[..., torch.Tensor]:
    def body(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        return decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **attention_kwargs,
        ).last_hidden_state  # fmt: skip

    return body


def split_lm_head(model: Any) -> tuple[LMHeadSplit | None, str]:
    """`model` as body + LM head when its logits are exactly `head(last hidden state)`, else
    `(None, why not)`. A wrapper (LoRA's adapter-free view) may answer for itself with an
    `lm_head_split()` method. Works through a peft model (its adapters live inside the base model's
    modules, so calling the base model's decoder runs them).

    Not fused, and why: a head that is not a plain `nn.Linear` (a LoRA-wrapped or quantized one);
    a head whose weight is a `DTensor` (FSDP2 shards it with the root unit, whose all-gather runs
    only in the whole model's forward); a model with no decoder to call (`get_decoder()`) or with
    a transform after the head (`_LOGIT_TRANSFORMS`).
    """
    if (own := getattr(model, "lm_head_split", None)) is not None:
        return own()
    base = get_base() if (get_base := getattr(model, "get_base_model", None)) else model
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if type(head) is not torch.nn.Linear:  # exactly: a subclass (e.g. quantized) may compute otherwise
        return None, f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
    if type(head.weight).__name__ == "DTensor" or type(base).__name__.startswith("FSDP"):
        return None, "its LM head is sharded (a DTensor: FSDP2 gathers it only in the whole model's forward)"
    config = getattr(base, "config", None)
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if transforms:
        return None, f"its logits are transformed after the head ({', '.join(transforms)})"
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    if not isinstance(decoder, torch.nn.Module) or decoder is base:
        return None, "it has no decoder to call without its head (get_decoder())"
    return LMHeadSplit(_decoder_body(decoder), head), ""


def fused_token_logprobs(
    split: LMHeadSplit,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float,
    first_scored: int = 0,
    entropy_grad: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` through the fused head: the body's hidden states of the positions that
    predict a scored token (`first_scored` to T-2) go through `head_logprobs_and_entropy`; the
    others never reach the head. Shapes: `[B, T]` -> (`[B, T-1]`, `[B, T-1]`) float32, 0 before `first_scored`.
    """
    B, T = tokens_BT.shape
    hidden_BTH = split.body(tokens_BT, attention_mask_BT)
    K = max(T - 1 - first_scored, 0)  # predictions computed: first_scored .. T-2
    hidden_NH = hidden_BTH[:, first_scored : first_scored + K].reshape(B * K, hidden_BTH.shape[-1])
    targets_N = tokens_BT[:, first_scored + 1 : first_scored + 1 + K].reshape(B * K)
    logprobs_N, entropy_N = head_logprobs_and_entropy(
        hidden_NH, split.head.weight, split.head.bias, targets_N, temperature, chunk_rows, entropy_grad
    )
    logprobs_BK, entropy_BK = logprobs_N.view(B, K), entropy_N.view(B, K)
    if K == T - 1:
        return logprobs_BK, entropy_BK
    skipped = logprobs_BK.new_zeros(B, T - 1 - K)
    return torch.cat([skipped, logprobs_BK], dim=1), torch.cat([skipped, entropy_BK], dim=1)
