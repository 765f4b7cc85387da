"""Micro-batches bounded by tokens: which rows of an optimizer step go through one forward together.

A rollout batch is right-padded to its longest sequence, so a micro-batch cut as a slice of it
(`batching.micro_batch_size` rows) costs rows × the whole batch's longest length, whatever its own rows
hold. With `batching.micro_batch_max_tokens`, a step's rows are instead grouped by length
(`plan_token_budget`) and each micro-batch is cut down to its own longest row
(`MicroBatch.width`): its padded tokens, the size of the logits and of the activations, stay
within the budget, whatever the longest sample of the batch.

Which rows share a micro-batch changes nothing in the gradient: the loss normalizers are counts
of the whole optimizer step (`GRPOModule._optimizer_step`), and the columns cut off are padding,
masked out of the loss.

A sequence longer than the budget cannot be split: it goes alone, over the budget. Such
micro-batches are counted (`train/micro_batches_over_budget`) and the first one is said once
(`BudgetWatch`); a budget below `data.max_seq_len` is named at start-up, since only then can one occur.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_grpo.maths.logprobs import first_scored_prediction, token_logprobs
from lit_grpo.maths.packing import PackingCost
from lit_grpo.maths.shared_prefix import PrefixGroup
from lit_grpo.types import MultiModalBatch

log = logging.getLogger(__name__)
OVER_BUDGET_METRIC = "train/micro_batches_over_budget"


def plan_token_budget(
    lengths: Sequence[int], max_tokens: int, max_sequences: int = 0, packed: bool = False
) -> list[list[int]]:
    """Group rows into micro-batches of at most `max_tokens` padded tokens (and at most
    `max_sequences` rows, 0: no bound), as lists of row indices.

    `packed` (padding-free micro-batches): a micro-batch costs the sum of its rows' lengths instead,
    and each row goes into the first micro-batch with room for it (`plan_packed_budget`).

    A micro-batch's padded tokens are its rows × its longest row's length. Rows are taken longest
    first (ties in row order) and each goes into the first micro-batch it fits in, else opens a new
    one (first-fit decreasing). A micro-batch's longest row is the one that opened it, so whether
    another row fits depends only on how many it holds, not on that row: once a micro-batch is full
    no later row fits it, and each micro-batch is a run of consecutive rows in longest-first order.
    A row longer than `max_tokens` gets a micro-batch of its own, over the budget (a sequence cannot
    be split). Deterministic: the same lengths give the same plan.

    Shapes: lengths `[B]` (tokens of each row) -> micro-batches in the order they were opened
    (longest rows first), each a list of row indices in increasing order; every row in exactly one.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_sequences < 0:
        raise ValueError(f"max_sequences must be >= 0 (0: no bound), got {max_sequences}")
    if packed:
        return plan_packed_budget(lengths, max_tokens, max_sequences)
    micro_batches: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda row: (-lengths[row], row)):
        last = micro_batches[-1] if micro_batches else []  # the only one that can still have room
        width = lengths[last[0]] if last else 0
        if last and (max_sequences == 0 or len(last) < max_sequences) and (len(last) + 1) * width <= max_tokens:
            last.append(row)
        else:
            micro_batches.append([row])
    return [sorted(rows) for rows in micro_batches]


def plan_packed_budget(lengths: Sequence[int], max_tokens: int, max_sequences: int = 0) -> list[list[int]]:
    """`plan_token_budget` for packed micro-batches: at most `max_tokens` real tokens each (the sum of
    its rows' lengths; padding costs nothing packed) and at most `max_sequences` rows (0: no bound).

    First-fit decreasing: rows longest first (ties in row order), each into the first micro-batch
    with room for it, else a new one; a row longer than `max_tokens` goes alone, over the budget.
    Deterministic. Shapes: lengths `[B]` -> micro-batches in the order opened, rows increasing.
    """
    micro_batches: list[list[int]] = []
    totals: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda row: (-lengths[row], row)):
        for i, rows in enumerate(micro_batches):
            if totals[i] + lengths[row] <= max_tokens and (max_sequences == 0 or len(rows) < max_sequences):
                rows.append(row)
                totals[i] += lengths[row]
                break
        else:
            micro_batches.append([row])
            totals.append(lengths[row])
    return [sorted(rows) for rows in micro_batches]


def sequence_lengths(attention_BT: torch.Tensor) -> list[int]:
    """Each row's length up to its last real token (the tokens a forward of it must keep).

    Right padding makes it the row's real tokens; it is robust to any other mask all the same.
    Shape: `[B, T]` -> B ints (a host copy: one device sync).
    """
    positions_T = torch.arange(1, attention_BT.shape[1] + 1, device=attention_BT.device)
    return (attention_BT.ne(0) * positions_T).amax(dim=1).tolist()


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a step's batch that go through one forward, and the tokens of each they keep."""

    rows: slice | torch.Tensor
    """A slice of the batch (its tensors are then views, no copy) or row indices, `[b]` long."""
    width: int
    """Tokens kept of each row: the micro-batch's longest row (the batch's T when not cut down)."""
    filler: bool = False
    """A forward whose result is thrown away (it trains nothing): it only takes part in the
    collectives of a sharded model, whose every forward gathers weights from all ranks."""
    packed_tokens: int = 0
    """Padding-free (`batching.padding_free`): its rows' real tokens, packed into one row by the
    forward; 0: its rows are padded to `width`."""
    prefix_groups: tuple[PrefixGroup, ...] = ()
    """Packed: its rows (indices among its own rows, in order) whose common first tokens the packed
    row holds once (`lit_grpo.maths.shared_prefix`)."""

    @property
    def prefix_tokens_saved(self) -> int:
        """Token rows its forward does not compute because its rows share them."""
        return sum(group.saved_tokens() for group in self.prefix_groups)

    def spans(self, lengths: Sequence[int]) -> list[tuple[int, int]]:
        """The positions its forward computes, as `(start, stop)` of each sequence or shared prefix
        (`lit_grpo.maths.flops`' spans): a group's prefix once, then each row's positions after it;
        other rows whole. `lengths`: every row's of the batch. Padding is not counted."""
        rows = range(self.rows.start, self.rows.stop) if isinstance(self.rows, slice) else self.rows.tolist()
        own = [lengths[row] for row in rows]
        spans: list[tuple[int, int]] = []
        grouped: set[int] = set()
        for group in self.prefix_groups:
            spans.append((0, group.prefix))
            spans += [(group.prefix, own[i]) for i in group.rows]
            grouped.update(group.rows)
        return spans + [(0, n) for i, n in enumerate(own) if i not in grouped]

    @property
    def packed(self) -> bool:
        """Whether its forward packs its rows into one (`packed_tokens`), else pads them."""
        return self.packed_tokens > 0

    @property
    def num_rows(self) -> int:
        """How many rows of the batch it holds."""
        return self.rows.stop - self.rows.start if isinstance(self.rows, slice) else self.rows.numel()

    @property
    def token_slots(self) -> int:
        """What its forward runs on: its rows' real tokens when packed, else its rows × its width."""
        if self.packed_tokens:
            return self.packed_tokens
        return self.num_rows * self.width

    def tokens(self, per_token_BT: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of a per-token tensor. Shape: `[B, T]` -> `[b, width]`."""
        return per_token_BT[self.rows, : self.width]

    def predictions(self, values: torch.Tensor) -> torch.Tensor:
        """Its part of per-sequence values, or of per-token ones aligned with the predictions
        (T tokens give T-1 of them). Shape: `[B]` -> `[b]`, `[B, T-1]` -> `[b, width-1]`."""
        return values[self.rows] if values.dim() == 1 else values[self.rows, : self.width - 1]

    def vision(self, multi_modal: MultiModalBatch | None) -> dict[str, torch.Tensor] | None:
        """Its rows' images as forward keyword tensors (`MultiModalBatch.select`); None: no images."""
        return None if multi_modal is None else multi_modal.select(self.rows) or None


def micro_slices(
    rows: slice,
    size: int,
    width: int,
    lengths: Sequence[int] | None = None,
    cost: PackingCost | None = None,
    rows_tokens: Sequence[Sequence[int]] | None = None,
    pack_always: bool = False,
) -> list[MicroBatch]:
    """Contiguous slices of `rows` of at most `size` rows (0: one slice of them all), `width` tokens
    each; with `lengths` (every row's), packed micro-batches of those real tokens where packing
    pays (`packed_micro_batch`), the others padded."""
    n = rows.stop - rows.start
    size = size if size > 0 else n
    slices = [slice(rows.start + i, rows.start + min(i + size, n)) for i in range(0, n, size)]
    if lengths is None:
        return [MicroBatch(part, width) for part in slices]
    return [
        packed_micro_batch(part, list(range(part.start, part.stop)), width, lengths, cost, rows_tokens, pack_always)
        for part in slices
    ]


def micro_lists(
    row_ids: Sequence[int],
    size: int,
    width: int,
    device: torch.device,
    lengths: Sequence[int] | None = None,
    cost: PackingCost | None = None,
    rows_tokens: Sequence[Sequence[int]] | None = None,
    pack_always: bool = False,
) -> list[MicroBatch]:
    """`micro_slices` of the rows `row_ids` (not contiguous: the micro-batches hold row indices)."""
    size = size if size > 0 else len(row_ids)
    micro_batches = []
    for i in range(0, len(row_ids), size):
        part = list(row_ids[i : i + size])
        rows = torch.tensor(part, dtype=torch.long, device=device)
        if lengths is None:
            micro_batches.append(MicroBatch(rows, width))
        else:
            micro_batches.append(packed_micro_batch(rows, part, width, lengths, cost, rows_tokens, pack_always))
    return micro_batches


def kept_rows(rows: slice, trained: Sequence[bool] | None) -> list[int] | None:
    """The rows of `rows` that `trained` marks, or None when that is all of them (or no marks). A
    minibatch none of whose rows trains keeps its first: every rank makes its forwards and backward
    (a zero gradient), as the collectives of a distributed step need."""
    if trained is None or all(trained[rows]):
        return None
    return [row for row in range(rows.start, rows.stop) if trained[row]] or [rows.start]


def packed_micro_batch(
    rows: slice | torch.Tensor,
    row_list: list[int],
    width: int,
    lengths: Sequence[int],
    cost: PackingCost | None,
    rows_tokens: Sequence[Sequence[int]] | None,
    pack_always: bool,
) -> MicroBatch:
    """The micro-batch of `rows` (`row_list`: the same, as ints), packed where `cost` says that pays
    (`PackingCost.pays`: the padding saved and what the rows' shared prefixes save, from their
    tokens `rows_tokens`, against the calls packing adds), or always with `pack_always` or no `cost`;
    else padded to `width`."""
    own = [lengths[row] for row in row_list]
    groups: tuple[PrefixGroup, ...] = ()
    saving = 0.0
    if cost is not None and rows_tokens is not None:
        groups, saving = cost.prefix_groups([rows_tokens[row] for row in row_list])
    if pack_always or cost is None or cost.pays(own, width, saving):
        return MicroBatch(rows, width, packed_tokens=max(1, sum(own)), prefix_groups=groups)
    return MicroBatch(rows, width)


def token_budget_micro_batches(
    lengths: Sequence[int],
    row_ids: Sequence[int],
    max_tokens: int,
    max_sequences: int,
    device: torch.device,
    packed: bool,
    cost: PackingCost | None = None,
    rows_tokens: Sequence[Sequence[int]] | None = None,
    pack_always: bool = False,
) -> list[MicroBatch]:
    """The token-bounded micro-batches of the step's rows `row_ids` (`plan_token_budget`), each cut
    to its own longest row (at least one token, for the forward); `packed`: padding-free ones
    (`packed_micro_batch`), but padded where packing does not pay and the padded rows keep to
    `max_tokens`."""
    micro_batches = []
    for micro in plan_token_budget([lengths[row] for row in row_ids], max_tokens, max_sequences, packed):
        row_list = [row_ids[i] for i in micro]
        width = max(1, max(lengths[row] for row in row_list))
        row_tensor = torch.tensor(row_list, dtype=torch.long, device=device)
        if not packed:
            micro_batches.append(MicroBatch(row_tensor, width))
            continue
        over = len(row_list) * width > max_tokens  # padded, it would break the budget
        micro_batches.append(
            packed_micro_batch(row_tensor, row_list, width, lengths, cost, rows_tokens, pack_always or over)
        )
    return micro_batches


@dataclass(frozen=True)
class ForwardPlan:
    """The micro-batches of one rollout step's forwards."""

    per_minibatch: list[list[MicroBatch]]
    """The training forwards of each optimizer step (PPO minibatch), gradients accumulated over them."""
    no_grad: list[MicroBatch]
    """The forwards over the whole batch without gradients (the reference's, `old`'s)."""
    token_slots: int
    """Tokens one pass over the batch computes, padding included (the real ones are the attention's)."""
    over_budget: tuple[int, ...] = ()
    """The lengths of the sequences longer than the token budget: each is a micro-batch of its own, over it."""
    lengths: tuple[int, ...] = ()
    """Every row's length (`sequence_lengths`) when the plan read them (packing or a budget), else ()."""

    @property
    def prefix_tokens_saved(self) -> int:
        """Token rows the training forwards do not compute because rows share a prefix (`perf/prefix_tokens_saved`)."""
        return sum(micro.prefix_tokens_saved for micros in self.per_minibatch for micro in micros)

    def spans(self, micros: Sequence[MicroBatch]) -> list[tuple[int, int]] | None:
        """The positions `micros` compute (`MicroBatch.spans`), fillers left out; None when the plan
        has no lengths (every sequence whole, as the caller counts them)."""
        if not self.lengths:
            return None
        return [span for micro in micros if not micro.filler for span in micro.spans(self.lengths)]


def plan_forwards(
    attention_BT: torch.Tensor,
    minibatches: list[slice],
    micro_batch_size: int,
    micro_batch_max_tokens: int,
    padding_free: bool = False,
    cost: PackingCost | None = None,
    tokens_BT: torch.Tensor | None = None,
    pack_always: bool = False,
    trained: Sequence[bool] | None = None,
) -> ForwardPlan:
    """The micro-batches of a step whose optimizer steps train on `minibatches` (rows of the batch).

    Without a token budget (`batching.micro_batch_max_tokens` 0): slices of `micro_batch_size` rows (0: all)
    of the padded batch, views of it, within each minibatch for training and over the whole batch
    for the no-gradient forwards. With one: token-bounded micro-batches within each minibatch
    (`plan_token_budget`), each cut to its own longest row, and the no-gradient forwards run the very
    same ones, so `old` is computed as the first minibatch's training forward computes the policy.
    `padding_free`: the micro-batches are packed (`MicroBatch.packed_tokens`), the budget counts real
    tokens, and the token slots are the real tokens: no padding computed; with `cost`, only those
    where packing pays (`PackingCost.pays`; all with `pack_always`), the others padded; and with
    `tokens_BT` too, a packed micro-batch's rows share their common prefix where that pays
    (`PackingCost.prefix_groups`). `trained` (one flag per row): only the marked rows go through
    the forwards, the others have no gradient and nothing reads their logprobs
    (`batching.skip_zero_advantage_rows`); the micro-batches then hold row indices.
    Shape: attention, tokens `[B, T]`; a host copy of the lengths (one device sync) with a budget or
    packing, and of the tokens when they may share prefixes.
    """
    B, T = attention_BT.shape
    lengths = sequence_lengths(attention_BT) if padding_free or micro_batch_max_tokens else None
    rows_tokens = None
    if padding_free and cost is not None and cost.shares_prefixes and tokens_BT is not None and lengths is not None:
        rows_tokens = [row[:n] for row, n in zip(tokens_BT.tolist(), lengths)]
    if micro_batch_max_tokens == 0:  # slices of the padded batch: views, no copy
        lengths_if_packed = lengths if padding_free else None

        kept = [kept_rows(rows, trained) for rows in minibatches]

        def micros(rows: slice | list[int]) -> list[MicroBatch]:
            if isinstance(rows, slice):
                return micro_slices(rows, micro_batch_size, T, lengths_if_packed, cost, rows_tokens, pack_always)
            device = attention_BT.device
            return micro_lists(rows, micro_batch_size, T, device, lengths_if_packed, cost, rows_tokens, pack_always)

        per_minibatch = [micros(rows if ids is None else ids) for rows, ids in zip(minibatches, kept)]
        if len(minibatches) == 1 and (minibatches[0] == slice(0, B) or kept[0] is not None):
            no_grad = per_minibatch[0]  # one minibatch of every row trained: the same micro-batches, planned once
        elif all(ids is None for ids in kept):
            no_grad = micros(slice(0, B))
        else:  # the rows the training passes compute, and only those
            no_grad = micros(
                [row for rows, ids in zip(minibatches, kept) for row in ids or range(rows.start, rows.stop)]
            )
        return ForwardPlan(per_minibatch, no_grad, sum(m.token_slots for m in no_grad), lengths=tuple(lengths or ()))
    assert lengths is not None
    per_minibatch = [
        token_budget_micro_batches(
            lengths,
            kept_rows(rows, trained) or range(rows.start, rows.stop),
            micro_batch_max_tokens,
            micro_batch_size,
            attention_BT.device,
            padding_free,
            cost,
            rows_tokens,
            pack_always,
        )
        for rows in minibatches
    ]
    no_grad = [micro for micros in per_minibatch for micro in micros]
    over_budget = tuple(m.width for m in no_grad if m.token_slots > micro_batch_max_tokens)
    return ForwardPlan(per_minibatch, no_grad, sum(m.token_slots for m in no_grad), over_budget, tuple(lengths))


TEXT_FILLER = MicroBatch(slice(0, 1), 2, filler=True)
"""A text batch's filler: two tokens of row 0, one prediction through every decoder layer."""


def filler_micro_batch(attention_BT: torch.Tensor, multi_modal: MultiModalBatch | None = None) -> MicroBatch:
    """The micro-batch `with_fillers` pads a rank's forwards with: `TEXT_FILLER`, or, for a batch
    with images, the first row that has some, whole (`sequence_lengths`), with its images.

    A vision-language filler must run the vision tower, as the other ranks' forwards of rows with
    images do: under FSDP2 the tower's blocks are units of their own (`_no_split_modules`, e.g.
    `Qwen2VLVisionBlock`), whose shards every rank's forward gathers together. And it must keep all
    of its row's image tokens: the model refuses images whose tokens are not all in the forward's
    (two tokens of a row with an image have none of them)."""
    if multi_modal is None:
        return TEXT_FILLER
    has_images = [any(sizes[row] for sizes in multi_modal.sizes_B.values()) for row in range(attention_BT.shape[0])]
    row = has_images.index(True)
    return MicroBatch(slice(row, row + 1), sequence_lengths(attention_BT[row : row + 1])[0], filler=True)


def with_fillers(plan: ForwardPlan, counts: Sequence[int], filler: MicroBatch = TEXT_FILLER) -> ForwardPlan:
    """`plan` with `filler` micro-batches appended (`filler_micro_batch`) so that the no-gradient
    pass makes `counts[0]` forwards and minibatch k makes `counts[k + 1]`: under FSDP2 every rank must
    run as many forwards and backwards as the rank with the most (each gathers shards from all)."""

    def padded(micros: list[MicroBatch], count: int) -> list[MicroBatch]:
        return micros + [filler] * (count - len(micros))

    per_minibatch = [padded(micros, count) for micros, count in zip(plan.per_minibatch, counts[1:])]
    return ForwardPlan(per_minibatch, padded(plan.no_grad, counts[0]), plan.token_slots, plan.over_budget, plan.lengths)


class BudgetWatch:
    """Counts each step's micro-batches over `batching.micro_batch_max_tokens` and says the first once."""

    def __init__(self, max_tokens: int, max_seq_len: int) -> None:
        self.max_tokens, self.max_seq_len = max_tokens, max_seq_len
        self.said = False

    def note(self, plan: ForwardPlan, step: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The step's `train/micro_batches_over_budget` (this rank's; none without a budget), and the
        warning the first time a sequence is longer than the budget."""
        if self.max_tokens == 0:
            return {}
        if plan.over_budget and not self.said:
            self.said = True
            log.warning(
                "step %d: a sequence of %d tokens is longer than batching.micro_batch_max_tokens=%d, so it goes "
                "through a forward and backward of its own, over the budget (a sequence cannot be split; counted in "
                "%s, said once): set batching.micro_batch_max_tokens to at least data.max_seq_len=%d to bound every "
                "forward",
                step,
                max(plan.over_budget),
                self.max_tokens,
                OVER_BUDGET_METRIC,
                self.max_seq_len,
            )
        return {OVER_BUDGET_METRIC: torch.tensor(float(len(plan.over_budget)), device=device)}


def forward_counts(plan: ForwardPlan) -> list[int]:
    """The forwards of each pass of `plan`: the no-gradient pass, then each minibatch's."""
    return [len(plan.no_grad), *(len(micros) for micros in plan.per_minibatch)]


@torch.no_grad()
def no_grad_logprobs(
    model: torch.nn.Module,
    tokens_BT: torch.Tensor,
    attention_BT: torch.Tensor,
    temperature: float,
    micros: list[MicroBatch],
    mask_BT: torch.Tensor | None = None,
    fused_head: bool = True,
    multi_modal: MultiModalBatch | None = None,
) -> torch.Tensor:
    """`model`'s logprobs of the whole batch (the reference's, `old`'s), one micro-batch at a time.

    Shapes: tokens, attention `[B, T]`, mask `[B, T-1]` (aligned with the predictions) -> `[B, T-1]`
    float32, 0 in the columns a micro-batch cut off (padding) and, with `mask_BT`, before the first
    column a micro-batch trains on (no LM head over a prompt: `token_logprobs`'s `first_scored`).
    Filler micro-batches run their forward and are dropped. `fused_head`: `token_logprobs`'s (the LM
    head applied a chunk of tokens at a time); a micro-batch the plan packed (`MicroBatch.packed`) runs packed;
    `multi_modal`: the rows' images, each micro-batch's given to its forward (`micro.vision`).
    """
    B, T = tokens_BT.shape
    logprobs_BT = torch.zeros(B, T - 1, dtype=torch.float32, device=tokens_BT.device)
    for micro in micros:
        first = 0 if micro.filler or mask_BT is None else first_scored_prediction(micro.predictions(mask_BT))
        part_BT = token_logprobs(
            model, micro.tokens(tokens_BT), micro.tokens(attention_BT), temperature, first,
            fused_head=fused_head, padding_free=micro.packed, vision=micro.vision(multi_modal),
            prefix_groups=micro.prefix_groups,
        )[0]  # fmt: skip
        if not micro.filler:
            logprobs_BT[micro.rows, : micro.width - 1] = part_BT
    return logprobs_BT
