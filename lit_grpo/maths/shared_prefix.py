"""A group's shared prompt computed once in a packed forward (Prefix Grouper, arXiv 2506.05433).

The G completions of one prompt start with the same P tokens, and under causal attention the
hidden states of those tokens depend on them alone: a packed forward of the G sequences computes
the same P rows G times. Laid out instead as the prefix once, then each sequence's suffix (its
tokens after the prefix), with positions that continue the prefix's,

    [ prefix: P tokens | suffix 1: S_1 | suffix 2: S_2 | ... ]    positions 0..P-1, then P..P+S_i-1

where the prefix attends causally to itself and each suffix to the whole prefix and causally to
itself, the forward computes (G - 1) × P fewer rows through every layer, with the same values and
gradients as the G sequences whole (autograd adds up what each suffix sends the prefix's rows).
A prediction from position t < P reads the prefix's row t; the prefix's last row predicts each
sequence's own first suffix token.

Which rows share, and how much, comes from the tokens themselves, not from where a prompt ends:
rows sorted by their tokens put common prefixes side by side, so the G samples of a prompt come
together, and so do completions that begin alike (their common start is shared too). Rows whose
prompts differ (other prompts, multi-turn rollouts whose earlier turns differ) share only the
tokens they really have in common, and only where that pays. `shared_prefix_groups` picks the
groups; `lit_grpo.maths.packing` lays them out and runs their attention.

A group's attention runs one of two ways, whichever costs less (`AttentionCosts`): one call over
the whole group with a mask (the square's pairs all computed: short groups, one call instead of
G), or a causal call per suffix over the prefix's and the suffix's queries, keys and values (each
row's own attention pairs, as unshared; only the prefix's projections and MLP are saved, and the
first call's prefix rows give the prefix its output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixGroup:
    """Rows of a micro-batch that share their first `prefix` tokens, computed once."""

    rows: tuple[int, ...]
    """The rows (indices into the micro-batch), at least two, in increasing order."""
    prefix: int
    """The tokens they share: at least 1, at most the shortest row's length."""
    dense: bool
    """Its attention in one masked call over the whole group; else one causal call per suffix over
    the prefix and that suffix (`AttentionCosts.saving`)."""

    def saved_tokens(self) -> int:
        """Token rows not computed: the prefix's copies in all but one row."""
        return (len(self.rows) - 1) * self.prefix


@dataclass(frozen=True)
class AttentionCosts:
    """A model's forward costs, in FLOPs, that decide whether and how a group shares its prefix."""

    per_token: float
    """One token through the decoder layers' weights."""
    per_pair: float
    """One (query, key) pair of attention scores and weighted values, over all layers."""
    per_call: float
    """One more attention call in every layer (Python and dispatch, in FLOPs of the same time)."""

    def unshared(self, prefix: int, suffixes: Sequence[int]) -> float:
        """Each row whole: a causal call each."""
        return sum(
            (prefix + s) * self.per_token + _causal(prefix + s) * self.per_pair + self.per_call for s in suffixes
        )

    def split(self, prefix: int, suffixes: Sequence[int]) -> float:
        """A causal call per suffix over the prefix's queries, keys and values and its own: its
        attention pairs are its row's, the prefix's rows go through the weights once."""
        rows = prefix + sum(suffixes)
        ends = [prefix + s for s in suffixes if s] or [prefix]  # all suffixes empty: the prefix alone
        return rows * self.per_token + sum(map(_causal, ends)) * self.per_pair + len(ends) * self.per_call

    def dense(self, prefix: int, suffixes: Sequence[int]) -> float:
        """The whole group in one masked call: every pair of its square is computed."""
        rows = prefix + sum(suffixes)
        return rows * self.per_token + rows * rows * self.per_pair + self.per_call

    def saving(self, prefix: int, suffixes: Sequence[int]) -> tuple[float, bool]:
        """What sharing `prefix` tokens saves over running the rows (of `suffixes` after it) unshared,
        in FLOPs (<= 0: it does not pay), and whether the dense call is the cheaper way."""
        split, dense = self.split(prefix, suffixes), self.dense(prefix, suffixes)
        return self.unshared(prefix, suffixes) - min(split, dense), dense < split


def _causal(n: int) -> int:
    """Pairs of a causal call over n tokens: the lower triangle with its diagonal."""
    return n * (n + 1) // 2


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` (of one type: lists, or tuples) have in common: a binary
    search on slices compared at C speed, not a Python loop over every token."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def shared_prefix_groups(rows_tokens: Sequence[Sequence[int]], costs: AttentionCosts) -> tuple[PrefixGroup, ...]:
    """The groups of rows whose common first tokens are computed once, where that pays (`costs`).

    Rows sorted by their tokens put rows with a common start side by side. A run of neighbours
    can share the fewest tokens any two neighbours in it have in common; or it splits where those
    are fewest and each part shares more. `_best_groups` takes whichever saves more FLOPs, all the
    way down: a 46-token prompt's 8 samples share their prompt, and are not merged with another
    prompt's samples over a common 30-token system prompt (unless that saves more). Deterministic;
    every row is in at most one group.

    Shapes: `rows_tokens` B rows of real tokens (host ints) -> groups whose rows index them.
    """
    order = sorted(range(len(rows_tokens)), key=lambda row: list(rows_tokens[row]))
    lengths = [len(tokens) for tokens in rows_tokens]
    commons = [common_prefix(rows_tokens[a], rows_tokens[b]) for a, b in zip(order, order[1:])]
    groups, _ = _best_groups(order, commons, lengths, costs)
    return tuple(sorted(groups, key=lambda g: g.rows[0]))


def _best_groups(
    run: list[int], commons: list[int], lengths: Sequence[int], costs: AttentionCosts
) -> tuple[list[PrefixGroup], float]:
    """The groups of `run` (rows in sorted order; `commons[i]`: tokens rows i and i+1 have in
    common) that save the most, and what they save."""
    if len(run) < 2:
        return [], 0.0
    fewest = min(commons)
    whole: tuple[list[PrefixGroup], float] = ([], 0.0)
    if fewest > 0:
        saving, dense = costs.saving(fewest, [lengths[row] - fewest for row in run])
        if saving > 0:
            whole = ([PrefixGroup(tuple(sorted(run)), fewest, dense)], saving)
    if fewest == max(commons):  # no split shares more
        return whole
    parts: tuple[list[PrefixGroup], float] = ([], 0.0)
    start = 0
    for i, common in enumerate([*commons, fewest]):
        if common == fewest:  # a split between rows i and i + 1 (and the run's end)
            groups, saving = _best_groups(run[start : i + 1], commons[start:i], lengths, costs)
            parts = (parts[0] + groups, parts[1] + saving)
            start = i + 1
    return parts if parts[1] > whole[1] else whole
