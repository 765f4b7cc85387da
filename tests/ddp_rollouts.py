"""A rollout factory for the DDP tests: the default rollout, with the row and the rank recorded
and the rank as the reward, so a test can see which rows each rank sampled and how the logged
reward pools the ranks."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from lit_grpo.rollouts.rollout import make_rollout_fn


def make_recording_rollout_fn(setup):
    inner = make_rollout_fn(setup)
    record_dir = Path(setup.extras["record_dir"])

    async def rollout_fn(row):
        rank = dist.get_rank() if dist.is_initialized() else 0
        with (record_dir / f"rows_rank{rank}.txt").open("a") as f:
            f.write(f"{os.getpid()} {row['prompt']}\n")
        sample = await inner(row)
        sample.reward = float(rank)
        return sample

    return rollout_fn
