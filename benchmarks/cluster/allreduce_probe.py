"""The rehearsal's first health check: every rank all-reduces its rank over gloo and prints one line.

Launched by torchrun on every node; a line `allreduce rank=R world=W sum=S host=H` with S = W(W-1)/2 on each
node says the rendezvous met, the process group formed across the hosts and a collective went through.
Tiny on purpose (one float, no model), so it can run beside anything. LIT_GRPO_PROBE_HOLD_S keeps the
ranks alive that long after the line (a running job to tear down or to inject faults into);
LIT_GRPO_PROBE_TIMEOUT_S bounds the process group's collectives (60 s).
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist


def main() -> None:
    timeout_s = float(os.environ.get("LIT_GRPO_PROBE_TIMEOUT_S", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    print(
        f"allreduce rank={rank} world={world} sum={value.item():g} host={socket.gethostname()}"
        f" master={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        flush=True,
    )
    time.sleep(float(os.environ.get("LIT_GRPO_PROBE_HOLD_S", "0")))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
