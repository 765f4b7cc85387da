"""The progress bar of a run: rollout steps out of `max_steps`, with the rate and the time left.

Lightning's bar takes its total from the training data's length, and a rollout stream has none,
so it counted steps with no total and no ETA. This one counts the steps the module trained (a
resumed run starts at its checkpoint's step) toward `max_steps` (none when `max_steps=-1`).
While it is drawn, the console's log lines are written above it (`tqdm.write`), never through it.
`lit_grpo.build` adds it when `trainer.enable_progress_bar` is true.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

# The loggers whose console handlers could print while the bar is drawn: the root's (Hydra's, or the
# caller's), and Lightning's own when nobody else prints (`lit_grpo.run.console.tidy_lightning_logging`).
CONSOLE_LOGGERS = ("", "lightning", "lightning.pytorch", "lightning.fabric")


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar over rollout steps: total `max_steps` (-1: unknown), the step's reward."""

    def __init__(self, max_steps: int, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.max_steps = max_steps
        self._redirect: Optional[contextlib.ExitStack] = None
        self._total: Optional[int] = None
        self._start = 0

    def init_train_tqdm(self) -> Tqdm:
        """The one bar, drawn once as `steps` with its total: Lightning's drew a `Training: 0/?`
        bar, reset it and renamed it per epoch, each a line of its own in a log that is no TTY."""
        return Tqdm(
            desc="steps",
            total=self._total,
            initial=self._start,  # the rate counts this run's steps
            position=(2 * self.process_position),
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # No bar yet (Lightning's would be drawn here): the checkpoint's step is known at the epoch's start.
        if self.is_enabled and self._redirect is None:
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(
                logging_redirect_tqdm([logging.getLogger(name) for name in CONSOLE_LOGGERS], tqdm_class=Tqdm)
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_progress_bar is not None:
            return  # the rollout stream is one epoch: one bar for the run (no reset, no rename)
        self._start = getattr(pl_module, "rollout_step", 0)  # a resumed run starts at its checkpoint's step
        self._total = self.max_steps if self.max_steps > 0 and not trainer.fast_dev_run else None
        self.train_progress_bar = self.init_train_tqdm()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        step = getattr(pl_module, "rollout_step", batch_idx + 1)
        if bar is not None and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_progress_bar is not None:  # none when the run stopped before its first epoch began
            super().on_train_end(trainer, pl_module)
        self._end_redirect()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._end_redirect()  # a run that raised ends here without on_train_end
        super().teardown(trainer, pl_module, stage)

    def _end_redirect(self) -> None:
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None


STEP_LINE_EVERY_S = 30.0
"""With no progress bar, a step's line is logged when this long has passed since the last one."""


class StepLogLine(L.Callback):
    """With the progress bar off (`trainer.enable_progress_bar=false`: CI, `nohup`, a cluster's job
    log), one log line per step, at most one per `every_s` seconds (and always the last step's):
    the step out of `max_steps`, its reward and its time, so a log is never silent for minutes.

    A step's metrics are recorded by the module's own `on_train_batch_end`, which Lightning calls
    after the callbacks': so a line is written for the latest recorded step (the one before), and
    the last one at the end of training."""

    def __init__(self, max_steps: int, metric: str = "reward/mean", every_s: float = STEP_LINE_EVERY_S) -> None:
        self.max_steps, self.metric, self.every_s = max_steps, metric, every_s
        self._last: Optional[float] = None
        self._said = 0  # steps whose line is written (or skipped)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return
        if self._say_latest(trainer, pl_module):
            self._last = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._say_latest(trainer, pl_module)

    def _say_latest(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Write the latest recorded step's line, once; whether one was written."""
        sequence = getattr(pl_module, "step_sequence", None)
        steps = sequence.history.steps if sequence is not None else []
        if not trainer.is_global_zero or len(steps) <= self._said:
            return False
        self._said, metrics = len(steps), steps[-1]
        parts = [f"step {len(steps)}" + (f"/{self.max_steps}" if self.max_steps > 0 else "")]
        for key, label in ((self.metric, self.metric), ("perf/step_s", "s/step")):
            if key in metrics:
                parts.append(f"{label} {float(metrics[key]):.4g}")
        logging.getLogger("lit_grpo.progress").info("%s", ", ".join(parts))
        return True
