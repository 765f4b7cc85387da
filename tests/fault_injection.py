"""Callbacks that kill the training process on purpose, for the crash/resume tests.

They are added from the command line (`+callbacks.kill={_target_: fault_injection.KillAfterStep, step: 5}`)
with this folder on PYTHONPATH, so the run under test is the real CLI, killed as a crash would.
"""

from __future__ import annotations

import os
import signal

import lightning as L

from lit_grpo.checkpoint import CheckpointStore


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: as a crash or an OOM kill


class KillAfterStep(L.Callback):
    """SIGKILL the process at the end of rollout step `step` (before that step's checkpoint, if any)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs:  # a trained step (empty when the stream ended)
            self.done += 1
            if self.done == self.step:
                _die()


class KillDuringSave(L.Callback):
    """SIGKILL the process while the checkpoint of `step` is being published: its shards and
    state files are written to the staging folder, the manifest and the rename are not done."""

    def __init__(self, step: int) -> None:
        original = CheckpointStore.publish

        def publish(store, at_step, staging, meta):
            if at_step == step:
                _die()
            return original(store, at_step, staging, meta)

        CheckpointStore.publish = publish
