"""A rollout factory for the peer-fault tests: the default rollout, except that rank
`extras.fail_rank` raises at its `extras.fail_after`-th call (a bug in the rollout: the run
stops at once on that rank), and every call of every rank appends a line to
`<extras.record_dir>/calls_rank<r>.txt`, so a test can wait for the run to be well under way."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from lit_grpo.rollouts.rollout import make_rollout_fn


def make_faulty_rollout_fn(setup):
    inner = make_rollout_fn(setup)
    record_dir = Path(setup.extras["record_dir"])
    fail_rank, fail_after = int(setup.extras.get("fail_rank", -1)), int(setup.extras.get("fail_after", 0))
    calls = 0

    async def rollout_fn(row):
        nonlocal calls
        rank = dist.get_rank() if dist.is_initialized() else 0
        calls += 1
        with (record_dir / f"calls_rank{rank}.txt").open("a") as f:
            f.write(f"{calls}\n")
        if rank == fail_rank and calls >= fail_after:
            raise ValueError(f"injected rollout fault on rank {rank}")
        return await inner(row)

    return rollout_fn
