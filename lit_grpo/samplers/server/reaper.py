"""`python -m lit_grpo.samplers.server.reaper PID`: when process PID is gone, its descendants go too.

vLLM runs its engine and workers in processes of their own. When the server's process dies
without stopping them (SIGKILL from an OOM killer or a preempting scheduler), they live on, and
on a GPU they keep its memory. `python -m lit_grpo.serve` starts this watcher beside itself: every
`PERIOD_S` it notes the server's descendants (from /proc, each with its start time, so a reused
pid is never mistaken for one); once the server is gone it sends them SIGTERM, then SIGKILL to
whatever is left after `GRACE_S`, and exits. Linux only (it reads /proc); elsewhere it exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

PERIOD_S = 0.5
GRACE_S = 3.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of `pid` from /proc, or None when it is gone (a zombie, killed but
    not yet reaped by its parent, is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])  # ppid, starttime (fields 4 and 22 of proc(5))


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time."""
    parents: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents.setdefault(stat[0], []).append(int(entry.name))
            started[int(entry.name)] = stat[1]
    found, todo = {}, [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found[child] = started[child]
                todo.append(child)
    return found


def _signal_all(known: dict[int, int], sig: int) -> int:
    """Send `sig` to every process of `known` still running as the same process; how many were."""
    alive = 0
    for pid, start in known.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == start:
            alive += 1
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    return alive


def watch(server_pid: int) -> None:
    """Note `server_pid`'s descendants until it is gone, then stop them."""
    server = _stat(server_pid)
    known: dict[int, int] = {}
    while server is not None and (_stat(server_pid) or (0, -1))[1] == server[1]:  # the same process (start time)
        known.update(descendants(server_pid))
        time.sleep(PERIOD_S)
    if _signal_all(known, signal.SIGTERM):
        end = time.monotonic() + GRACE_S
        while time.monotonic() < end and _signal_all(known, 0):
            time.sleep(0.1)
        _signal_all(known, signal.SIGKILL)


def main() -> None:
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        raise SystemExit("usage: python -m lit_grpo.samplers.server.reaper PID")
    if Path("/proc/self/stat").exists():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a group stop of the server must not stop the watch early
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch(int(sys.argv[1]))


if __name__ == "__main__":
    main()
