"""Selected-token logprobs and entropy from logits, without a `[B, T, V]` float32 temporary.

The naive computation, `log_softmax(logits.float() / temperature).gather(target)` plus the entropy
`-(p * logp).sum(-1)`, materializes several float32 tensors the size of the logits: with Qwen2.5's
vocabulary (151,936) each one is 0.6 GB per 1,024 tokens. Here the rows of the logits (one row per
token, V wide) are processed a chunk at a time, in the forward and again in the backward:

- forward keeps only the logits themselves (no copy), the targets and two floats per row (its
  max and log-sum-exp);
- backward recomputes the softmax chunk by chunk and writes
  `grad_logits = g * (onehot(target) - softmax) / temperature` into one gradient tensor of the
  logits' dtype, the only logits-sized allocation (autograd needs it anyway).

Besides the logits and their gradient, the memory used is two float32 chunks in the forward and
one in the backward (two when the entropy is differentiated too, for an entropy bonus; else
the entropy is detached, a metric).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable

from lit_grpo.maths.head_logprobs import fused_token_logprobs, head_logprobs_and_entropy, split_lm_head
from lit_grpo.maths.multimodal import VisionInputs, split_vlm_head, vision_forward_kwargs
from lit_grpo.maths.packing import (
    SEGMENTED_SDPA,
    pack_rows,
    packed_forward,
    packing_support,
    unpack_predictions,
    use_segmented_sdpa,
)
from lit_grpo.maths.shared_prefix import PrefixGroup
from lit_grpo.maths.softmax_chunks import chunk_forward, chunk_grad, default_chunk_rows

log = logging.getLogger(__name__)

CausalLM = Any
"""A transformers causal LM, a peft model over one, or LoRA's adapter-free view of it: called as
`model(input_ids=..., attention_mask=...)` for an output with `.logits`."""


def _row_spans(start: int, stop: int, seq_len: int) -> Iterator[tuple[int, int, int, int]]:
    """Rows `[start, stop)` of the flattened `[B * T]` tokens, split at sequence boundaries.

    Yields `(b, t_start, t_stop, offset)`: rows `t_start:t_stop` of sequence `b` are rows
    `offset:offset + (t_stop - t_start)` of the chunk. Working per sequence, never on a flattened
    view, keeps non-contiguous logits (such as `logits[:, :-1]`) from being copied whole.
    """
    row = start
    while row < stop:
        b, t = divmod(row, seq_len)
        n = min(seq_len - t, stop - row)
        yield b, t, t + n, row - start
        row += n


def _load_scaled_chunk(
    logits_BTV: torch.Tensor, start: int, stop: int, temperature: float, out_CV: torch.Tensor
) -> torch.Tensor:
    """`logits.float() / temperature` for flattened rows `[start, stop)`, written into `out_CV`.

    Shapes: logits `[B, T, V]`, out `[chunk_rows, V]` float32 -> a `[stop - start, V]` view of out.
    """
    chunk_CV = out_CV[: stop - start]
    if logits_BTV.is_contiguous():  # one copy (a model's logits): a per-sequence loop costs B small copies
        chunk_CV.copy_(logits_BTV.view(-1, logits_BTV.shape[-1])[start:stop])
    else:
        for b, t0, t1, offset in _row_spans(start, stop, logits_BTV.shape[1]):
            chunk_CV[offset : offset + t1 - t0].copy_(logits_BTV[b, t0:t1])
    # Divide (not multiply by 1/temperature) to round exactly as the naive `logits / temperature`.
    return chunk_CV.div_(temperature) if temperature != 1.0 else chunk_CV  # x / 1 is x: a pass saved


def _store_chunk(chunk_CV: torch.Tensor, grad_BTV: torch.Tensor, start: int, stop: int) -> None:
    """Copy a chunk of flattened rows `[start, stop)` into `grad_BTV` `[B, T, V]` (contiguous), casting to its dtype."""
    grad_BTV.view(-1, grad_BTV.shape[-1])[start:stop].copy_(chunk_CV[: stop - start])


class _SelectedLogprobs(torch.autograd.Function):
    """Autograd for `selected_logprobs_and_entropy`; saves the logits (no copy), not their softmax."""

    @staticmethod
    def forward(
        ctx, logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float, chunk_rows: int, entropy_grad: bool
    ):
        B, T, V = logits_BTV.shape
        n_rows = B * T
        targets_N = targets_BT.reshape(n_rows)
        selected_BT, entropy_BT = (torch.empty(B, T, dtype=torch.float32, device=logits_BTV.device) for _ in range(2))
        row_max_N, log_sum_exp_N = torch.empty(2, n_rows, dtype=torch.float32, device=logits_BTV.device)
        scaled_CV = torch.empty(min(chunk_rows, n_rows), V, dtype=torch.float32, device=logits_BTV.device)
        work_CV = torch.empty_like(scaled_CV)
        for start in range(0, n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            rows = slice(start, stop)
            chunk_CV = _load_scaled_chunk(logits_BTV, start, stop, temperature, scaled_CV)
            selected_C, entropy_C, row_max_N[rows], log_sum_exp_N[rows] = chunk_forward(
                chunk_CV, targets_N[rows], work_CV[: stop - start]
            )
            selected_BT.view(n_rows)[rows], entropy_BT.view(n_rows)[rows] = selected_C, entropy_C
        ctx.save_for_backward(logits_BTV, targets_N, row_max_N, log_sum_exp_N, entropy_BT.view(n_rows))
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy_BT)
        return selected_BT, entropy_BT

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_selected_BT: torch.Tensor | None, grad_entropy_BT: torch.Tensor | None):
        if (grad_selected_BT is None and grad_entropy_BT is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        logits_BTV, targets_N, row_max_N, log_sum_exp_N, entropy_N = ctx.saved_tensors
        B, T, V = logits_BTV.shape
        n_rows, chunk_rows = B * T, ctx.chunk_rows
        grad_N = (
            grad_selected_BT.reshape(n_rows).float()
            if grad_selected_BT is not None
            else torch.zeros(n_rows, device=logits_BTV.device)
        )
        grad_H_N = None if grad_entropy_BT is None else grad_entropy_BT.reshape(n_rows).float()
        # The one logits-sized allocation: the gradient itself, in the logits' dtype.
        grad_logits_BTV = torch.empty(B, T, V, dtype=logits_BTV.dtype, device=logits_BTV.device)
        scaled_CV = torch.empty(min(chunk_rows, n_rows), V, dtype=torch.float32, device=logits_BTV.device)
        work_CV = torch.empty_like(scaled_CV) if grad_H_N is not None else None
        for start in range(0, n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            rows = slice(start, stop)
            chunk_CV = _load_scaled_chunk(logits_BTV, start, stop, ctx.temperature, scaled_CV)
            entropy_grad = None
            if grad_H_N is not None and work_CV is not None:
                entropy_grad = (grad_H_N[rows], entropy_N[rows], work_CV[: stop - start])
            grad_CV = chunk_grad(
                chunk_CV,
                targets_N[rows],
                row_max_N[rows],
                log_sum_exp_N[rows],
                grad_N[rows],
                ctx.temperature,
                entropy_grad,
            )
            _store_chunk(grad_CV, grad_logits_BTV, start, stop)
        return grad_logits_BTV, None, None, None, None


def selected_logprobs_and_entropy(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target token and the entropy of each position's tempered distribution.

    Equals `log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0]`
    and `-(p * log p).sum(-1)` of that distribution, with gradients (to the logits, in their
    dtype) for the logprob, and for the entropy too with `entropy_grad` (an entropy bonus; the
    backward then needs a second float32 chunk); else the entropy is detached. Computed `chunk_rows` tokens (rows of
    the flattened `B * T`) at a time, so no float32 tensor larger than `[chunk_rows, V]` is made
    besides the outputs; `None` picks rows for a ~32 MiB chunk (`default_chunk_rows`).
    Every target must be a valid id, padding included (its logprob is simply ignored by the caller).

    Shapes: logits `[B, T, V]` (any float dtype, any strides), targets `[B, T]` int64 ->
    (`[B, T]` float32, `[B, T]` float32).
    """
    if logits_BTV.dim() != 3 or targets_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"logits [B, T, V] and targets [B, T] expected, got {tuple(logits_BTV.shape)} and {tuple(targets_BT.shape)}"
        )
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(logits_BTV.shape[-1])
    if rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {rows}")
    return _SelectedLogprobs.apply(logits_BTV, targets_BT.long(), float(temperature), rows, entropy_grad)


def token_logprobs(
    model: CausalLM,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float,
    first_scored: int = 0,
    entropy_grad: bool = False,
    fused_head: bool = True,
    padding_free: bool = False,
    vision: Optional[VisionInputs] = None,
    prefix_groups: Sequence[PrefixGroup] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs of each token and the policy's entropy at each position.

    A forward over T tokens predicts T-1 of them: position t of the output scores token t+1.
    Logits are divided by the sampling temperature so the logprobs are those of the
    distribution the sampler drew from. Shapes: [B, T] -> ([B, T-1], [B, T-1]); the entropy is
    detached unless `entropy_grad` (an entropy bonus differentiates it).
    Computed a chunk of tokens at a time (`lit_grpo.maths.logprobs`): no [B, T, V] float32 copy of the logits.

    `first_scored` > 0 skips the LM head for the predictions before it (a prompt nobody trains on):
    the model computes logits for the last T - first_scored positions only (transformers'
    `logits_to_keep`), which at a 150k vocabulary is most of the cost of a prompt's tokens, in the
    forward and again in the backward; the skipped predictions come back as 0 (logprob and entropy).

    With `fused_head` (`model.fused_lm_head`), a model whose logits are exactly its LM head applied
    to its last hidden states is run without its head, and the head is applied a chunk of tokens at
    a time (`lit_grpo.maths.head_logprobs`): no `[B, T, V]` logits at all, forward or backward.
    Other models (`split_lm_head` says which, in a debug line) take the path below: the model's own
    logits, turned into logprobs a chunk at a time.

    With `padding_free` (`batching.padding_free`), a model that supports it (`packing_support`;
    else a debug line says why) runs the rows' real tokens packed into one row: no padding computed
    (`packed_token_logprobs`); padding columns then come back as 0. `prefix_groups`: rows whose
    common first tokens that packed row holds once (`lit_grpo.maths.shared_prefix`; the model must
    run `SEGMENTED_SDPA`); the same values, fewer rows computed.

    With `vision` (the rows' images as the forward takes them, `lit_grpo.maths.multimodal`), a
    vision-language policy runs on the tokens and the images: padded (never packed), its fused
    head through the whole multimodal body (`split_vlm_head`). None or empty: the text path, unchanged.
    """
    T = tokens_BT.shape[1]
    forward_kwargs = vision_forward_kwargs(model, tokens_BT, vision) if vision else None
    if padding_free and forward_kwargs is None:  # rows with images stay padded
        why_not = packing_support(model)
        if not why_not:
            first = first_scored if 0 < first_scored < T - 1 else 0
            return packed_token_logprobs(
                model, tokens_BT, attention_mask_BT, temperature, first, entropy_grad, fused_head, prefix_groups
            )
        _say_once(model, f"padding-free micro-batches off: {why_not}; rows are padded instead")
    if fused_head:
        split, why_not = split_lm_head(model) if forward_kwargs is None else split_vlm_head(model, forward_kwargs)
        if split is not None:
            first = first_scored if 0 < first_scored < T - 1 else 0
            return fused_token_logprobs(split, tokens_BT, attention_mask_BT, temperature, first, entropy_grad)
        images = "" if forward_kwargs is None else " with images"
        _say_once(model, f"fused LM head off{images}: {why_not}; its full logits are computed instead")
    return _unfused_token_logprobs(
        model, tokens_BT, attention_mask_BT, temperature, first_scored, entropy_grad, forward_kwargs
    )


def _unfused_token_logprobs(
    model: CausalLM,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float,
    first_scored: int,
    entropy_grad: bool,
    forward_kwargs: Optional[dict[str, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` from the model's own logits (`forward_kwargs`: the images, if any)."""
    T = tokens_BT.shape[1]
    first_scored = first_scored if 0 < first_scored < T - 1 and keeps_logits(model) else 0
    kept = {"logits_to_keep": T - first_scored} if first_scored else {}
    logits_BKV = model(
        input_ids=tokens_BT, attention_mask=attention_mask_BT, use_cache=False, **kept, **(forward_kwargs or {})
    ).logits
    # Scored over every position kept (the last one against a dummy target, then dropped): the
    # gradient of a `logits[:, :-1]` slice would cost a zero-filled [B, K, V] tensor and a copy in backward.
    targets_BK = torch.cat([tokens_BT[:, first_scored + 1 :], tokens_BT[:, :1]], dim=1)
    logprobs_BK, entropy_BK = selected_logprobs_and_entropy(
        logits_BKV, targets_BK, temperature, entropy_grad=entropy_grad
    )
    if not first_scored:
        return logprobs_BK[:, :-1], entropy_BK[:, :-1]
    skipped = logprobs_BK.new_zeros(tokens_BT.shape[0], first_scored)
    return torch.cat([skipped, logprobs_BK[:, :-1]], dim=1), torch.cat([skipped, entropy_BK[:, :-1]], dim=1)


def packed_token_logprobs(
    model: CausalLM,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float,
    first_scored: int = 0,
    entropy_grad: bool = False,
    fused_head: bool = True,
    prefix_groups: Sequence[PrefixGroup] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of the rows packed into one (`lit_grpo.maths.packing`): one forward over
    their real tokens only, position ids restarting at each sequence, no attention mask (transformers
    builds the block-diagonal one, or sdpa runs each sequence alone: `packed_forward`). Only the
    predictions of real tokens from `first_scored` on reach the LM head (through the fused head when
    the model splits, `split_lm_head`). `prefix_groups`: rows whose common prefix is packed once.
    Shapes: `[B, T]` -> (`[B, T-1]`, `[B, T-1]`) float32, 0 where nothing is predicted.
    """
    if prefix_groups and not use_segmented_sdpa(model):
        _say_once(model, f"shared prefixes off: the model does not run {SEGMENTED_SDPA}; each row is computed whole")
        prefix_groups = ()
    packed = pack_rows(tokens_BT, attention_mask_BT, first_scored, prefix_groups)
    split = split_lm_head(model)[0] if fused_head else None
    if split is not None:
        with packed_forward(model, packed) as attention_kwargs:
            hidden_1NH = split.body(packed.tokens_1N, None, packed.positions_1N, **attention_kwargs)
        hidden_MH = hidden_1NH[0].index_select(0, packed.predicting_M)
        head = split.head
        logprobs_M, entropy_M = head_logprobs_and_entropy(
            hidden_MH, head.weight, head.bias, packed.targets_M, temperature, entropy_grad=entropy_grad
        )
    else:
        with packed_forward(model, packed) as attention_kwargs:
            logits_1NV = model(
                input_ids=packed.tokens_1N, position_ids=packed.positions_1N, use_cache=False, **attention_kwargs
            ).logits
        if packed.shares_prefixes:  # a prefix's last row predicts a token of each suffix: one logits row per prediction
            logprobs_1M, entropy_1M = selected_logprobs_and_entropy(
                logits_1NV[:, packed.predicting_M], packed.targets_M[None], temperature, entropy_grad=entropy_grad
            )
            return unpack_predictions(packed, logprobs_1M[0]), unpack_predictions(packed, entropy_1M[0])
        # Each position against the next packed token (across a boundary a dummy, never kept).
        targets_1N = torch.roll(packed.tokens_1N, -1, dims=1)
        logprobs_1N, entropy_1N = selected_logprobs_and_entropy(
            logits_1NV, targets_1N, temperature, entropy_grad=entropy_grad
        )
        logprobs_M, entropy_M = logprobs_1N[0, packed.predicting_M], entropy_1N[0, packed.predicting_M]
    return unpack_predictions(packed, logprobs_M), unpack_predictions(packed, entropy_M)


_SAID: set[tuple[str, str]] = set()


def _say_once(model: CausalLM, line: str) -> None:
    """One debug line per kind of model and line: why a faster path is not taken for it."""
    key = (type(model).__name__, line)
    if key not in _SAID:
        _SAID.add(key)
        log.debug("%s: %s", *key)


def keeps_logits(model: CausalLM) -> bool:
    """Whether `model`'s forward takes transformers' `logits_to_keep` (through a peft wrapper)."""
    cached = getattr(model, "_lit_grpo_keeps_logits", None)
    if cached is None:
        import inspect

        base = get_base() if (get_base := getattr(model, "get_base_model", None)) else model
        cached = "logits_to_keep" in inspect.signature(base.forward).parameters
        setattr(model, "_lit_grpo_keeps_logits", cached)  # noqa: B010  (not an attribute of its class)
    return bool(cached)


def first_scored_prediction(mask_BT: torch.Tensor) -> int:
    """The first prediction column any row trains on (its loss mask), or 0 when none does.

    Shape: mask `[B, T-1]` (aligned with the predictions) -> an int (one read from the device).
    """
    columns = mask_BT.ne(0).any(dim=0).nonzero()
    return int(columns[0]) if columns.numel() else 0
