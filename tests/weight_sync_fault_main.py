"""`python -m lit_grpo.train` for the peer-fault tests, except that rank `LIT_GRPO_TEST_SYNC_FAIL_RANK`'s
weight sync fails (a `WeightSyncError`, as when its vLLM server's engine dies mid-sync) from its
`LIT_GRPO_TEST_SYNC_FAIL_AT`-th push on. Lightning's launcher starts the other ranks with this same
command, so every rank runs it."""

from __future__ import annotations

import os

from lit_grpo.rollouts.datamodule import RolloutDataModule
from lit_grpo.samplers.server.weight_files import WeightSyncError
from lit_grpo.train import cli

FAIL_RANK = int(os.environ["LIT_GRPO_TEST_SYNC_FAIL_RANK"])
FAIL_AT = int(os.environ["LIT_GRPO_TEST_SYNC_FAIL_AT"])
push_weights = RolloutDataModule.push_weights
pushes = 0


def failing_push_weights(self, named_tensors, version: int) -> None:
    global pushes
    pushes += 1
    if int(os.environ.get("LOCAL_RANK", "0")) == FAIL_RANK and pushes >= FAIL_AT:
        raise WeightSyncError(f"weight sync to version {version} failed on http://infer-test:8000 (injected)")
    push_weights(self, named_tensors, version)


RolloutDataModule.push_weights = failing_push_weights

if __name__ == "__main__":
    cli()
