"""One prefill per distinct prompt of a generate batch: the G completions of a GRPO group share it.

A batch of B = P·G rows holds each group's prompt G times; generate would encode every copy. Here
the distinct prompts, all but their last token, run once through the model into a KV cache, whose
rows are then repeated to the batch's (`Cache.reorder_cache`): generate finds the cache filled and
runs each row's last prompt token and what follows. The keys and values are the ones each copy's own
prefill computes (the same tokens, positions and mask), so only float rounding may differ.

Positions are made as generate makes them for a left-padded batch (the attention mask's cumulative
sum, 0 at padding), so the cache is what generate's own prefill would have left.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)


def distinct_rows(input_ids_NW: torch.Tensor, attention_NW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each distinct row `[U]`, the distinct row of each row `[N]`), rows compared by their
    ids and mask together; the first occurrence stands for each. Shapes: `[N, W]` -> `[U]`, `[N]`."""
    keys = torch.cat([input_ids_NW, attention_NW.to(input_ids_NW.dtype)], dim=1)
    _, inverse_N = torch.unique(keys, dim=0, return_inverse=True)
    first_of: dict[int, int] = {}
    for row, group in enumerate(inverse_N.tolist()):
        first_of.setdefault(group, row)
    order = sorted(first_of, key=first_of.__getitem__)  # distinct rows in the order they first appear
    position = {group: u for u, group in enumerate(order)}
    return (
        torch.tensor([first_of[g] for g in order], dtype=torch.long),
        torch.tensor([position[g] for g in inverse_N.tolist()], dtype=torch.long),
    )


def shared_prompt_cache(
    model: Any, input_ids_NW: torch.Tensor, attention_NW: torch.Tensor
) -> Optional[tuple[Any, int]]:
    """The KV cache of every row's prompt but its last token, computed once per distinct prompt and
    repeated to the `N` rows (a transformers `DynamicCache`), for `generate(past_key_values=...)`,
    with the prompt tokens that were not encoded again; None where nothing is saved (no two rows
    alike, prompts of one token) or the model's cache cannot be built this way (one debug line says
    why). Shapes: `[N, W]` left-padded prompts."""
    from transformers import DynamicCache

    N, W = input_ids_NW.shape
    if W < 2:
        return None
    firsts_U, inverse_N = distinct_rows(input_ids_NW, attention_NW)
    if len(firsts_U) == N:
        return None
    ids_UW, mask_UW = input_ids_NW[firsts_U], attention_NW[firsts_U]
    head_ids, head_mask = ids_UW[:, :-1], mask_UW[:, :-1]
    positions = (head_mask.long().cumsum(-1) - 1).masked_fill(head_mask == 0, 0)
    try:
        cache = DynamicCache(config=model.config)
        model(
            input_ids=head_ids,
            attention_mask=head_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the head's output is not needed: one position, not W
        )
    except (TypeError, ValueError, NotImplementedError) as err:
        log.debug("prompts prefilled per row: the shared prefill failed (%s: %s)", type(err).__name__, err)
        return None
    cache.reorder_cache(inverse_N.to(head_ids.device))  # type: ignore[arg-type]  # a LongTensor, as typed
    saved = int(attention_NW[:, :-1].sum()) - int(head_mask.sum())
    return cache, saved
