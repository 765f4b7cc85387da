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

Rows that begin with the same tokens (a group's prompt) can share them: under `SEGMENTED_SDPA` the
packed row holds that prefix once, then each row's suffix, and the attention runs per block
(`PackedBlock`; `lit_grpo.maths.shared_prefix` says which rows and why it is exact).

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
from typing import Any

import torch

from lit_grpo.maths.shared_prefix import AttentionCosts, PrefixGroup, shared_prefix_groups

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
    cost each packed sequence adds; and, under `SEGMENTED_SDPA`, which rows share their prefix."""

    flops_per_token: float
    """Forward FLOPs of one token through the model's decoder layers (2 per weight)."""
    flops_per_sequence: float
    """What a packed sequence adds, in those FLOPs: its own attention call in every layer under
    `SEGMENTED_SDPA`; 0 where one call covers the packed row (flash-attention's varlen, a mask)."""
    flops_per_pair: float = 0.0
    """Forward FLOPs of one (query, key) pair of attention over all layers (scores and values)."""
    shares_prefixes: bool = False
    """Whether a packed forward may compute rows' common prefix once (`shared_prefix_groups`): only
    `SEGMENTED_SDPA` runs the shared layout's attention."""

    def pays(self, lengths: Sequence[int], width: int, shared_saving: float = 0.0) -> bool:
        """Pack the rows of `lengths` (real tokens each) rather than pad them to `width`?
        `shared_saving`: the FLOPs their shared prefixes save besides (`prefix_groups`)."""
        padding = len(lengths) * width - sum(lengths)
        return padding * self.flops_per_token + shared_saving > len(lengths) * self.flops_per_sequence

    def prefix_groups(self, rows_tokens: Sequence[Sequence[int]]) -> tuple[tuple[PrefixGroup, ...], float]:
        """The groups of rows (of these real tokens) that share a prefix where it pays, and the FLOPs
        that saves; none where the model's attention cannot run the shared layout."""
        if not self.shares_prefixes:
            return (), 0.0
        costs = AttentionCosts(self.flops_per_token, self.flops_per_pair, self.flops_per_sequence)
        groups = shared_prefix_groups(rows_tokens, costs)
        lengths = [len(tokens) for tokens in rows_tokens]
        return groups, sum(costs.saving(g.prefix, [lengths[r] - g.prefix for r in g.rows])[0] for g in groups)


def packing_cost(model: Any, device_type: str, share_prefixes: bool = True) -> PackingCost:
    """`model`'s `PackingCost` on a device of `device_type` ("cpu", "cuda", ...); `share_prefixes`:
    let rows share a common prefix where the model runs `SEGMENTED_SDPA`."""
    # The embedding is a lookup, and the LM head runs on the predicted positions either way.
    ends = {id(m.weight): m.weight.numel() for m in _embeddings(model)}
    weights = sum(p.numel() for p in model.parameters()) - sum(ends.values())
    base = get_base() if (get_base := getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    layers = getattr(config, "num_hidden_layers", None) or 1
    heads = getattr(config, "num_attention_heads", None) or 1
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", None) or 0) // heads
    per_call = SEGMENT_CALL_FLOPS.get(device_type, SEGMENT_CALL_FLOPS["cuda"])
    segmented = use_segmented_sdpa(model)
    return PackingCost(
        flops_per_token=2.0 * max(weights, 1),
        flops_per_sequence=layers * per_call if segmented else 0.0,
        flops_per_pair=4.0 * heads * head_dim * layers,  # Q·Kᵀ and P·V: 2 FLOPs per multiply-add each
        shares_prefixes=share_prefixes and segmented,
    )


def _embeddings(model: Any) -> list[Any]:
    """`model`'s input embedding and LM head modules that it has (one weight when tied)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if getattr(module, "weight", None) is not None:
            found.append(module)
    return found


@dataclass(frozen=True)
class PackedBlock:
    """A span of the packed row whose attention stays within it: one sequence, or a group of
    sequences that share their first tokens (`lit_grpo.maths.shared_prefix`)."""

    start: int
    """Where it starts in the packed row."""
    prefix: int
    """Its first tokens, attended causally: the whole sequence, or the group's shared prefix."""
    suffixes: tuple[int, ...] = ()
    """The group's suffixes after the prefix (lengths; 0 for a sequence that is all prefix), each
    attending to the whole prefix and causally to itself; () for a sequence alone."""
    dense: bool = False
    """A group attended in one masked call, else one causal call per suffix over the prefix and itself."""

    @property
    def stop(self) -> int:
        return self.start + self.prefix + sum(self.suffixes)


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's real tokens in one row, and where each computed prediction comes from and goes."""

    tokens_1N: torch.Tensor
    """`[1, N]` the sequences' real tokens in blocks (a shared prefix once), in order of their first rows."""
    positions_1N: torch.Tensor
    """`[1, N]` each token's position in its own sequence (0 at each sequence's first token; a
    suffix's continue its prefix's)."""
    predicting_M: torch.Tensor
    """`[M]` index in the packed row of each position whose next token is scored (a shared
    prefix's row serves every sequence of its group)."""
    targets_M: torch.Tensor
    """`[M]` the token each of them predicts (the next one of its own sequence)."""
    rows_M: torch.Tensor
    """`[M]` its row in the padded `[b, T-1]` predictions."""
    columns_M: torch.Tensor
    """`[M]` its column there."""
    shape: tuple[int, int]
    """`(b, T - 1)`: the padded predictions' shape."""
    blocks: tuple[PackedBlock, ...]
    """The attention blocks, in packed order, covering the row (no empty sequence)."""

    @property
    def shares_prefixes(self) -> bool:
        return any(block.suffixes for block in self.blocks)


def pack_rows(
    tokens_BT: torch.Tensor, attention_BT: torch.Tensor, first_scored: int = 0, groups: Sequence[PrefixGroup] = ()
) -> PackedRows:
    """Pack the real tokens (attention 1) of each row into one row, each `groups`' shared prefix
    once (its first row's tokens) followed by its rows' suffixes; other rows whole, in row order.

    The predictions computed are those of padded column `t` >= `first_scored` whose position and
    next position are both real tokens of the row: exactly the ones the padded forward makes that
    are not padding. Right padding (lit_grpo's rollout batches) gives positions 0..L-1 in each
    sequence, as the padded forward's.

    Shapes: tokens, attention `[b, T]` -> `PackedRows` with N = attention's ones less the shared
    copies, M <= b × (T - 1).
    """
    real_BT = attention_BT.ne(0)
    b, T = real_BT.shape
    lengths = real_BT.sum(dim=1).tolist()
    # Each row's shared prefix (0: none), where that prefix starts and where the row's own tokens start.
    prefix_B, prefix_start_B, own_start_B = [0] * b, [0] * b, [0] * b
    group_of = {row: g for g in groups for row in g.rows}
    blocks: list[PackedBlock] = []
    cursor = 0
    for row in range(b):
        group = group_of.get(row)
        if group is None:
            if lengths[row]:
                blocks.append(PackedBlock(cursor, lengths[row]))
                own_start_B[row] = cursor
                cursor += lengths[row]
        elif row == group.rows[0]:  # the group's block: the prefix, then each row's suffix in row order
            suffixes = tuple(lengths[r] - group.prefix for r in group.rows)
            blocks.append(PackedBlock(cursor, group.prefix, suffixes, group.dense))
            at = cursor + group.prefix
            for r, suffix in zip(group.rows, suffixes):
                prefix_B[r], prefix_start_B[r], own_start_B[r] = group.prefix, cursor, at - group.prefix
                at += suffix
            cursor = at
    device = tokens_BT.device
    position_BT = real_BT.long().cumsum(dim=1) - 1  # each real token's position in its own sequence
    in_prefix_BT = position_BT < torch.tensor(prefix_B, device=device)[:, None]
    packed_index_BT = position_BT + torch.where(
        in_prefix_BT,
        torch.tensor(prefix_start_B, device=device)[:, None],
        torch.tensor(own_start_B, device=device)[:, None],
    )
    # A token is laid out once: a row's own tokens, and a shared prefix from its group's first row.
    leads = torch.tensor([group_of[r].rows[0] == r if r in group_of else True for r in range(b)], device=device)
    laid_BT = real_BT & (~in_prefix_BT | leads[:, None])
    tokens_1N = tokens_BT.new_empty(1, cursor)
    tokens_1N[0, packed_index_BT[laid_BT]] = tokens_BT[laid_BT]
    positions_1N = torch.empty(1, cursor, dtype=torch.long, device=device)
    positions_1N[0, packed_index_BT[laid_BT]] = position_BT[laid_BT]
    predicts_BT = real_BT[:, :-1] & real_BT[:, 1:]
    if first_scored > 0:
        predicts_BT[:, :first_scored] = False
    rows_M, columns_M = predicts_BT.nonzero(as_tuple=True)
    return PackedRows(
        tokens_1N=tokens_1N,
        positions_1N=positions_1N,
        predicting_M=packed_index_BT[:, :-1][predicts_BT],
        targets_M=tokens_BT[:, 1:][predicts_BT],
        rows_M=rows_M,
        columns_M=columns_M,
        shape=(b, T - 1),
        blocks=tuple(blocks),
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


BlockMask = tuple[PackedBlock, "torch.Tensor | None"]
"""A block and the boolean mask (True: attends) its attention takes, made once per forward for all
layers: `[n, n]` for a group attended in one call (`PackedBlock.dense`), else None."""


def block_mask(block: PackedBlock, device: torch.device) -> BlockMask:
    """`block` with its mask (`BlockMask`): a dense group's keys are those before the query in the
    prefix or in the query's own suffix."""
    if not (block.suffixes and block.dense):
        return block, None
    segment_n = torch.repeat_interleave(
        torch.arange(len(block.suffixes) + 1, device=device),
        torch.tensor([block.prefix, *block.suffixes], device=device),
    )
    n = segment_n.numel()
    causal_nn = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return block, causal_nn & ((segment_n[None, :] == 0) | (segment_n[None, :] == segment_n[:, None]))


def _segmented_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_blocks: tuple[BlockMask, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`SEGMENTED_SDPA`'s attention: transformers' `sdpa_attention_forward` once per block of the
    packed row (`packed_blocks`, from `packed_forward`): a sequence alone with `is_causal`; a group
    sharing a prefix in one masked call, or one causal call per suffix over the prefix and itself.
    Outside a packed forward: once, as it is.

    Shapes: query `[1, heads, N, d]`, key and value `[1, kv_heads, N, d]` -> (`[1, N, heads, d]`, None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_blocks is None:
        if _IN_PACKED_FORWARD.get():  # no mask was built: attending across the whole row would be wrong
            raise RuntimeError(
                f"{type(module).__name__} does not pass its forward's keyword arguments to its attention, so "
                "its packed sequences cannot be told apart; set batching.padding_free=false"
            )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    n_tokens = packed_blocks[-1][0].stop if packed_blocks else 0
    if query.shape[0] != 1 or not query.shape[2] == key.shape[2] == n_tokens:
        raise ValueError(f"one packed row of {n_tokens} tokens expected, got {tuple(query.shape)}")
    if kwargs.get("position_bias") is not None:  # a bias over the whole row: not sliced per sequence here
        raise RuntimeError(
            f"{type(module).__name__} adds a position bias to its attention scores, which packed sequences do not "
            "support here; set batching.padding_free=false"
        )
    kwargs.pop("is_causal", None)

    def attend(parts: list[slice], mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of the tokens of `parts` (spans of the packed row, in order) among themselves:
        causal, or under `mask`."""
        q, k, v = (
            x[:, :, parts[0]] if len(parts) == 1 else torch.cat([x[:, :, part] for part in parts], dim=2)
            for x in (query, key, value)
        )
        return sdpa_attention_forward(
            module, q, k, v, None if mask is None else mask[None, None], is_causal=mask is None, **kwargs
        )[0]

    outputs = []
    for block, mask in packed_blocks:
        whole = slice(block.start, block.stop)
        if not block.suffixes or mask is not None:
            outputs.append(attend([whole], mask))
            continue
        # A causal call per suffix over the prefix and itself; the prefix's output from the first one.
        prefix = slice(block.start, block.start + block.prefix)
        start, prefix_done = prefix.stop, False
        for suffix_len in block.suffixes:
            suffix = slice(start, start + suffix_len)
            start = suffix.stop
            if suffix_len:
                out = attend([prefix, suffix], None)
                outputs += [out] if not prefix_done else [out[:, block.prefix :]]
                prefix_done = True
        if not prefix_done:  # every row is all prefix
            outputs.append(attend([prefix], None))
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
    """The keyword arguments a packed forward of `model` passes on to its attention: the packed
    row's blocks and their masks when it runs `SEGMENTED_SDPA` (`use_segmented_sdpa`), with its
    mask skipped on this thread for the forward's length; else none (transformers builds the
    block-diagonal mask from the position ids, which cannot say that suffixes share a prefix)."""
    if not use_segmented_sdpa(model):
        if packed.shares_prefixes:
            raise ValueError(f"{type(model).__name__} does not run {SEGMENTED_SDPA}: its rows cannot share prefixes")
        yield {}
        return
    token = _IN_PACKED_FORWARD.set(True)
    try:
        device = packed.tokens_1N.device
        yield {"packed_blocks": tuple(block_mask(block, device) for block in packed.blocks)}
    finally:
        _IN_PACKED_FORWARD.reset(token)
