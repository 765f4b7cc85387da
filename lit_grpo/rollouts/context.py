"""The context keywords a rollout function may declare: where its row is and which call it is.

A rollout function is called `rollout_fn(row)`; one that declares some of `CONTEXT_KEYWORDS` (or
`**kwargs`) gets those too, the cookbook's names and meanings:

- `epoch`: the pass over the rows (0, 1, ...);
- `row_index`: the row's index in the run's rows (stable across epochs and ranks);
- `cursor_index`: the row's position in the whole run's row order (all epochs, all ranks);
- `end_of_epoch`: the row is the last of its epoch (for this rank);
- `rollout_idx` / `sample_index`: which of the row's G calls this is (0..G-1);
- `evaluation`: True when called by an evaluation (`evaluation_fn`), else False.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional

CONTEXT_KEYWORDS = frozenset(
    {"cursor_index", "row_index", "epoch", "rollout_idx", "sample_index", "end_of_epoch", "evaluation"}
)


def declared_context(rollout_fn: Callable[..., Any]) -> frozenset[str]:
    """The context keywords `rollout_fn` accepts: all of them with `**kwargs`, else those it names."""
    try:
        params = inspect.signature(rollout_fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: call it with the row only
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return CONTEXT_KEYWORDS
    return CONTEXT_KEYWORDS & params.keys()


class RolloutCalls:
    """`rollout_fn` with the context keywords it declares bound, per call (inspected once)."""

    def __init__(self, rollout_fn: Callable[..., Any]) -> None:
        self.rollout_fn = rollout_fn
        self.names = declared_context(rollout_fn)

    def bound(
        self, call_index: int, context: Optional[dict] = None, *, evaluation: bool = False
    ) -> Callable[[dict], Any]:
        """The callable for call `call_index` of a row with `context` (`epoch`, `row_index`, ...)."""
        if not self.names:
            return self.rollout_fn
        values = {**(context or {}), "rollout_idx": call_index, "sample_index": call_index, "evaluation": evaluation}
        return functools.partial(self.rollout_fn, **{k: v for k, v in values.items() if k in self.names})


def make_evaluation_rollout_fn(rollout_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`rollout_fn` for an evaluation: called `(row, **context)`, it passes on the context keywords
    the rollout declares, with `evaluation=True`."""
    names = declared_context(rollout_fn)

    async def evaluation_rollout_fn(row: dict, **context: Any) -> Any:
        values = {**context, "evaluation": True}
        return await rollout_fn(row, **{k: v for k, v in values.items() if k in names})

    return evaluation_rollout_fn
