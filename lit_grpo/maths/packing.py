"""Padding-free forwards: a micro-batch's sequences packed into one row, no pad token computed.

A right-padded micro-batch `[b, T]` computes b × T token slots, most of them padding when the
completions are ragged (the longest sets T). Packed, its real tokens become one row `[1, N]`
(N = the sum of the lengths), with position ids restarting at 0 at each sequence's first token.
transformers reads the sequence boundaries from those position ids when no attention mask is
given: its mask utilities (`masking_utils.find_packed_sequence_indices`) build a block-diagonal
causal mask for sdpa, eager and flex attention, and flash-attention takes its varlen path.
`packing_support` says which models take that route.

sdpa with that mask computes the whole `[N, N]` score matrix (on a CPU torch's kernel skips no
masked block), N² where the sequences need the sum of their squares (7.5× more for 8 ragged
1,024-token completions), and holds the mask (0.4 GB of booleans for a 20k-token row). So a model whose attention is
plain causal sdpa is switched to `SEGMENTED_SDPA` (`use_segmented_sdpa`), registered with
transformers: outside a packed forward it is transformers' sdpa unchanged; in one (`packed_forward`)
no mask is built and transformers' own sdpa function runs on each sequence's slice of the queries,
keys and values with `is_causal`, as flash-attention's varlen path does on a GPU. No attention
arithmetic is written here.

Packing is not free: `SEGMENTED_SDPA` makes one attention call per sequence and layer, a fixed
cost that a tiny model's few FLOPs per token never win back (a tiny model's step on 4-token
completions ran 2.4× slower packed). `PackingCost` weighs, per micro-batch, the padding a padded
forward would compute against the calls a packed one adds, and the micro-batch is packed only
where that pays.

The layout (`pack_rows`) keeps, for each prediction to compute, where it lives in the packed row
and where its value goes back in `[b, T-1]` (`unpack_predictions`): a prediction never crosses a
boundary, as the last token of a sequence predicts nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import torch

# transformers' sdpa, each packed sequence alone in a packed forward (see above): registered under this name.
SEGMENTED_SDPA = "lit_grpo_segmented_sdpa"
# transformers' attention implementations whose masks follow packed position ids (see above).
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", SEGMENTED_SDPA)
# Set on the thread of a packed forward of a `SEGMENTED_SDPA` model: its mask is not built.
_IN_PACKED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("lit_grpo_packed_forward", default=False)


SEGMENT_CALL_FLOPS = {"cpu": 4e6, "cuda": 5e9}
"""The fixed cost of one more attention call, in FLOPs of matmul work done in the same time: about
0.1 ms of Python and dispatch per call at a CPU core's ~40 GFLOP/s, 20 µs of launches at a GPU's
~250 TFLOP/s. Other devices take the GPU's figure (packing only where padding is large)."""


@dataclass(frozen=True)
class PackingCost:
    """Whether packing a micro-batch pays: the padding a padded forward computes, against the fixed
    cost each packed sequence adds."""

    flops_per_token: float
    """Forward FLOPs of one token through the model's decoder layers (2 per weight)."""
    flops_per_sequence: float
    """What a packed sequence adds, in those FLOPs: its own attention call in every layer under
    `SEGMENTED_SDPA`; 0 where one call covers the packed row (flash-attention's varlen, a mask)."""

    def pays(self, lengths: Sequence[int], width: int) -> bool:
        """Pack the rows of `lengths` (real tokens each) rather than pad them to `width`?"""
        padding = len(lengths) * width - sum(lengths)
        return padding * self.flops_per_token > len(lengths) * self.flops_per_sequence


def packing_cost(model: Any, device_type: str) -> PackingCost:
    """`model`'s `PackingCost` on a device of `device_type` ("cpu", "cuda", ...)."""
    # The embedding is a lookup, and the LM head runs on the predicted positions either way.
    ends = {id(m.weight): m.weight.numel() for m in _embeddings(model)}
    weights = sum(p.numel() for p in model.parameters()) - sum(ends.values())
    base = get_base() if (get_base := getattr(model, "get_base_model", None)) else model
    layers = getattr(getattr(base, "config", None), "num_hidden_layers", None) or 1
    per_call = SEGMENT_CALL_FLOPS.get(device_type, SEGMENT_CALL_FLOPS["cuda"])
    return PackingCost(2.0 * max(weights, 1), layers * per_call if use_segmented_sdpa(model) else 0.0)


def _embeddings(model: Any) -> list[Any]:
    """`model`'s input embedding and LM head modules that it has (one weight when tied)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if getattr(module, "weight", None) is not None:
            found.append(module)
    return found


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's real tokens in one row, and where each computed prediction comes from and goes."""

    tokens_1N: torch.Tensor
    """`[1, N]` the sequences' real tokens, one after the other, in row order."""
    positions_1N: torch.Tensor
    """`[1, N]` each token's position in its own sequence (0 at each sequence's first token)."""
    predicting_M: torch.Tensor
    """`[M]` index in the packed row of each position whose next token is scored."""
    targets_M: torch.Tensor
    """`[M]` the token each of them predicts (the next one of its own sequence)."""
    rows_M: torch.Tensor
    """`[M]` its row in the padded `[b, T-1]` predictions."""
    columns_M: torch.Tensor
    """`[M]` its column there."""
    shape: tuple[int, int]
    """`(b, T - 1)`: the padded predictions' shape."""
    bounds: tuple[int, ...]
    """Where each sequence starts in the packed row, then N: `(0, L_0, L_0 + L_1, ..., N)` (no empty sequence)."""


def pack_rows(tokens_BT: torch.Tensor, attention_BT: torch.Tensor, first_scored: int = 0) -> PackedRows:
    """Pack the real tokens (attention 1) of each row into one row, in row order.

    The predictions computed are those of padded column `t` >= `first_scored` whose position and
    next position are both real tokens of the row: exactly the ones the padded forward makes that
    are not padding. Right padding (lit_grpo's rollout batches) gives positions 0..L-1 in each
    sequence, as the padded forward's.

    Shapes: tokens, attention `[b, T]` -> `PackedRows` with N = attention's ones, M <= N - b.
    """
    real_BT = attention_BT.ne(0)
    positions_BT = real_BT.long().cumsum(dim=1) - 1
    # Index of each real token in the packed row (row-major order of the real tokens).
    packed_index_BT = real_BT.flatten().long().cumsum(dim=0).view_as(real_BT) - 1
    predicts_BT = real_BT[:, :-1] & real_BT[:, 1:]
    if first_scored > 0:
        predicts_BT[:, :first_scored] = False
    rows_M, columns_M = predicts_BT.nonzero(as_tuple=True)
    lengths = [int(n) for n in real_BT.sum(dim=1).tolist() if n > 0]
    return PackedRows(
        tokens_1N=tokens_BT[real_BT].unsqueeze(0),
        positions_1N=positions_BT[real_BT].unsqueeze(0),
        predicting_M=packed_index_BT[:, :-1][predicts_BT],
        targets_M=tokens_BT[:, 1:][predicts_BT],
        rows_M=rows_M,
        columns_M=columns_M,
        shape=(tokens_BT.shape[0], tokens_BT.shape[1] - 1),
        bounds=tuple(accumulate(lengths, initial=0)),
    )


def unpack_predictions(packed: PackedRows, values_M: torch.Tensor) -> torch.Tensor:
    """Per-prediction values back in the padded layout, 0 where nothing was computed (padding,
    columns before `first_scored`); differentiable in `values_M`.

    Shapes: `[M]` -> `[b, T-1]` of values' dtype.
    """
    out_BT = values_M.new_zeros(packed.shape)
    return out_BT.index_put((packed.rows_M, packed.columns_M), values_M)


def _modeling_module(model: Any) -> Any:
    """The transformers modeling module that defines `model`'s class (through wrappers' subclasses, such as FSDP2's)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return sys.modules.get(cls.__module__)
    return None


def packing_support(model: Any) -> str:
    """Why `model` cannot run packed sequences as exactly as padded ones, or "" when it can.

    It can when it is a transformers model whose modeling code builds its mask with transformers'
    mask utilities (`create_causal_mask`, which detect packed position ids) under one of the
    attention implementations that honour them (`PACKED_ATTENTION`), and whose forward takes
    `position_ids`. A multimodal model (a `vision_config`) is left padded: its rotary positions are
    not the plain per-sequence ones packed here. Through a peft model or LoRA's adapter-free view
    (`get_base_model`). Cached on the model.
    """
    return str(_once_per_model(model, "_lit_grpo_packing_support", _why_not_packed))


def _why_not_packed(base: Any) -> str:
    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    module = _modeling_module(base)
    if module is None:
        return f"{type(base).__name__} is not a transformers model"
    if getattr(config, "vision_config", None) is not None:
        return "it is multimodal (its rotary positions are not one plain range per sequence)"
    if implementation not in PACKED_ATTENTION:
        return f"its attention implementation {implementation!r} is not one of {', '.join(PACKED_ATTENTION)}"
    if not hasattr(module, "create_causal_mask"):
        return f"{module.__name__} does not build its mask with transformers' create_causal_mask"
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return "its forward takes no position_ids"
    return ""


def _once_per_model(model: Any, attribute: str, compute: Callable[[Any], Any]) -> Any:
    """`compute(base)` of `model`'s transformers model (through peft or LoRA's view: `get_base_model`)
    the first time, then the value cached on `model` as `attribute`."""
    cached = getattr(model, attribute, None)
    if cached is None:
        cached = compute(get_base() if (get_base := getattr(model, "get_base_model", None)) else model)
        try:
            setattr(model, attribute, cached)
        except AttributeError:  # a wrapper that takes no new attributes: asked again next time
            pass
    return cached


def _segmented_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    segment_bounds: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`SEGMENTED_SDPA`'s attention: transformers' `sdpa_attention_forward`, once per packed
    sequence (`segment_bounds`, from `packed_forward`) with `is_causal`, else once as it is.

    Shapes: query `[1, heads, N, d]`, key and value `[1, kv_heads, N, d]` -> (`[1, N, heads, d]`, None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if segment_bounds is None:
        if _IN_PACKED_FORWARD.get():  # no mask was built: attending across the whole row would be wrong
            raise RuntimeError(
                f"{type(module).__name__} does not pass its forward's keyword arguments to its attention, so "
                "its packed sequences cannot be told apart; set batching.padding_free=false"
            )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or not query.shape[2] == key.shape[2] == segment_bounds[-1]:
        raise ValueError(f"one packed row of {segment_bounds[-1]} tokens expected, got {tuple(query.shape)}")
    if kwargs.get("position_bias") is not None:  # a bias over the whole row: not sliced per sequence here
        raise RuntimeError(
            f"{type(module).__name__} adds a position bias to its attention scores, which packed sequences do not "
            "support here; set batching.padding_free=false"
        )
    kwargs.pop("is_causal", None)
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], None,
            is_causal=True, **kwargs,
        )[0]
        for start, stop in pairwise(segment_bounds)
    ]  # fmt: skip
    return torch.cat(outputs, dim=1), None


def _segmented_sdpa_mask(attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """`SEGMENTED_SDPA`'s mask: none in a packed forward (each sequence is causal by itself), else sdpa's."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and _IN_PACKED_FORWARD.get():
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)  # transformers passes every argument by name


def use_segmented_sdpa(model: Any) -> bool:
    """Switch `model` (a transformers model, through peft or LoRA's view) from sdpa to
    `SEGMENTED_SDPA` when every layer's attention is plain causal (no sliding window, no chunked or
    other layer types), and say whether it runs it; once per model (cached). Models loaded with
    another implementation keep it.
    """
    return bool(_once_per_model(model, "_lit_grpo_segmented_sdpa", _switch_to_segmented_sdpa))


def _switch_to_segmented_sdpa(base: Any) -> bool:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    plain_causal = (
        getattr(config, "sliding_window", None) is None
        and getattr(config, "attention_chunk_size", None) is None
        and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())
    )
    if implementation == "sdpa" and plain_causal and hasattr(base, "set_attn_implementation"):
        AttentionInterface.register(SEGMENTED_SDPA, _segmented_sdpa_attention)
        AttentionMaskInterface.register(SEGMENTED_SDPA, _segmented_sdpa_mask)
        base.set_attn_implementation(SEGMENTED_SDPA)
        implementation = SEGMENTED_SDPA
    return implementation == SEGMENTED_SDPA


@contextlib.contextmanager
def packed_forward(model: Any, packed: PackedRows) -> Iterator[dict[str, Any]]:
    """The keyword arguments a packed forward of `model` passes on to its attention: the sequences'
    bounds when it runs `SEGMENTED_SDPA` (`use_segmented_sdpa`), with its mask skipped on this
    thread for the forward's length; else none (transformers builds the block-diagonal mask)."""
    if not use_segmented_sdpa(model):
        yield {}
        return
    token = _IN_PACKED_FORWARD.set(True)
    try:
        yield {"segment_bounds": packed.bounds}
    finally:
        _IN_PACKED_FORWARD.reset(token)
