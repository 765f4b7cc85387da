"""Padding-free forwards: a micro-batch's sequences packed into one row, no pad token computed.

A right-padded micro-batch `[b, T]` computes b × T token slots, most of them padding when the
completions are ragged (the longest sets T). Packed, its real tokens become one row `[1, N]`
(N = the sum of the lengths), with position ids restarting at 0 at each sequence's first token.
transformers reads the sequence boundaries from those position ids when no attention mask is
given: its mask utilities (`masking_utils.find_packed_sequence_indices`) build a block-diagonal
causal mask for sdpa, eager and flex attention, and flash-attention takes its varlen path. No
attention is written here; `packing_support` says which models take that route.

The layout (`pack_rows`) keeps, for each prediction to compute, where it lives in the packed row
and where its value goes back in `[b, T-1]` (`unpack_predictions`): a prediction never crosses a
boundary, as the last token of a sequence predicts nothing.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch

# transformers' attention implementations whose masks follow packed position ids (see above).
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


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
    return PackedRows(
        tokens_1N=tokens_BT[real_BT].unsqueeze(0),
        positions_1N=positions_BT[real_BT].unsqueeze(0),
        predicting_M=packed_index_BT[:, :-1][predicts_BT],
        targets_M=tokens_BT[:, 1:][predicts_BT],
        rows_M=rows_M,
        columns_M=columns_M,
        shape=(tokens_BT.shape[0], tokens_BT.shape[1] - 1),
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
    cached = getattr(model, "_lit_grpo_packing_support", None)
    if cached is not None:
        return str(cached)
    base = get_base() if (get_base := getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    module = _modeling_module(base)
    why_not = ""
    if module is None:
        why_not = f"{type(base).__name__} is not a transformers model"
    elif getattr(config, "vision_config", None) is not None:
        why_not = "it is multimodal (its rotary positions are not one plain range per sequence)"
    elif implementation not in PACKED_ATTENTION:
        why_not = f"its attention implementation {implementation!r} is not one of {', '.join(PACKED_ATTENTION)}"
    elif not hasattr(module, "create_causal_mask"):
        why_not = f"{module.__name__} does not build its mask with transformers' create_causal_mask"
    elif "position_ids" not in inspect.signature(base.forward).parameters:
        why_not = "its forward takes no position_ids"
    try:
        setattr(model, "_lit_grpo_packing_support", why_not)  # noqa: B010  (not an attribute of its class)
    except AttributeError:
        pass
    return why_not
