"""A run's console: each line once, no third-party advertisement, and the stop reason the run had.

Lightning gives its `lightning` logger a handler of its own when imported, and its records also
reach the root logger's handlers, which Hydra's job logging sets up: every Lightning line would be
printed twice. It also logs advertisements ("💡 Tip: ... litlogger") and ends every run with
"`Trainer.fit` stopped: `max_epochs=1` reached", which is not why a lit_grpo run stops (its
rollout stream ends it). `tidy_lightning_logging` fixes the first two and drops that line; the
run's own last line is `stop_reason`'s ("stopped: max_steps=20 reached").
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

LIGHTNING_NOISE = ("💡 Tip:", "`Trainer.fit` stopped:")
"""Starts of the Lightning records dropped: advertisements, and a stop reason that is not the run's."""
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
"""The loggers Lightning's `rank_zero_info` writes those records to."""
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class LightningNoise(logging.Filter):
    """Drops the records of `LIGHTNING_NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_NOISE)


_NOISE = LightningNoise()


def tidy_lightning_logging() -> None:
    """Filter Lightning's noise; and when the root logger has handlers (Hydra's, or the caller's),
    remove the console handlers Lightning's loggers added to themselves and let their records go to
    the root's, so each line is printed once (and reaches Hydra's log file). Idempotent; call it after
    Lightning is imported, before the trainer is built."""
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _NOISE not in logger.filters:
            logger.addFilter(_NOISE)
    if not logging.getLogger().handlers:
        return  # nobody else prints: Lightning's own handlers are the only ones
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's console handler (not a file or a capture)
                logger.removeHandler(handler)
        logger.propagate = True


def stop_reason(*, steps: int, max_steps: int, rows_exhausted: bool, signum: Optional[int], fast_dev_run: bool) -> str:
    """Why a run that returned stopped, as its last line says it: `steps` trained in all (a resumed
    run's included), the config's `max_steps` (-1: none), whether the rows ran out, the stop signal."""
    if signum is not None:
        return f"stopped: {signal.Signals(signum).name} after {steps} steps"
    if fast_dev_run:
        return f"stopped: trainer.fast_dev_run ({steps} step{'s' if steps != 1 else ''})"
    if rows_exhausted:
        return f"stopped: the rows ran out after {steps} of max_steps={max_steps} steps"
    if max_steps >= 0 and steps >= max_steps:
        return f"stopped: max_steps={max_steps} reached"
    if max_steps < 0:
        return f"stopped: the rows are used up after {steps} steps"
    return (
        f"stopped: the trainer ended fit after {steps} of max_steps={max_steps} steps "
        "(trainer.max_epochs or a callback)"
    )
