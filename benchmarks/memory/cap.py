"""A memory cap for a benchmark's child process: a case that does not fit is reported, not OOM-killed.

A cgroup v2 child group with `memory.max` where this machine has a writable one with the memory
controller (removed afterwards), else a watchdog thread that reads the child's resident memory
(its descendants' included) from /proc every 20 ms and kills it over the cap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def cgroup2_memory_parent() -> Path | None:
    """This process's cgroup v2 folder when it can hold a child group with a memory limit, else None."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
        root = next(Path(line.split()[1]) for line in mounts if line.split()[2] == "cgroup2")
        own = next(
            line.split("::", 1)[1]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
    except (OSError, StopIteration, IndexError):
        return None
    parent = root / own.strip().lstrip("/")
    try:
        if "memory" not in (parent / "cgroup.controllers").read_text().split():
            return None
        if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            (parent / "cgroup.subtree_control").write_text("+memory")  # fails (EBUSY) where processes live in it
        return parent if os.access(parent, os.W_OK) else None
    except OSError:
        return None


def guard_kind() -> str:
    """How children are capped here: a cgroup v2 group, else the RSS watchdog."""
    return "cgroup v2 memory.max" if cgroup2_memory_parent() is not None else "RSS watchdog"


@dataclass
class GuardedRun:
    returncode: int
    stdout: str
    stderr: str
    over_cap: bool
    guard: str
    timed_out: bool = False


def run_capped(command: list[str], cap_bytes: int, timeout_s: float, cwd: Path | None = None) -> GuardedRun:
    """Run `command` (in `cwd`) with its memory capped at `cap_bytes` (a cgroup v2 group, else an RSS watchdog)."""
    parent = cgroup2_memory_parent()
    group = None
    if parent is not None:
        try:
            group = parent / f"lit_grpo_train_step_{os.getpid()}_{time.monotonic_ns()}"
            group.mkdir()
            (group / "memory.max").write_text(str(cap_bytes))
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
        except OSError:
            if group is not None and group.exists():
                _remove_group(group)
            group = None
    procs = None if group is None else str(group / "cgroup.procs")

    def enter_group() -> None:  # in the child, before exec: it is capped from its first allocation
        if procs is not None:
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))

    over = threading.Event()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=enter_group if procs is not None else None,
    )
    done = threading.Event()
    if group is None:
        threading.Thread(target=_watchdog, args=(proc.pid, cap_bytes, over, done), daemon=True).start()
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        timed_out = True
    finally:
        done.set()
    if group is not None:
        try:
            events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
            if int(events.get("oom_kill", 0)) > 0:
                over.set()
        except (OSError, ValueError):
            pass
        _remove_group(group)
    return GuardedRun(proc.returncode, stdout, stderr, over.is_set(), "cgroup" if group else "watchdog", timed_out)


def _remove_group(group: Path) -> None:
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants (0 once gone)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as status:
            total = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:")), 0)
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                total += sum(_rss_bytes(int(child)) for child in children.read().split())
    except (OSError, ValueError):
        pass
    return total


def _watchdog(pid: int, cap_bytes: int, over: threading.Event, done: threading.Event) -> None:
    """Kill `pid` (SIGKILL) the first time its RSS is over `cap_bytes`; poll every 20 ms."""
    while not done.wait(0.02):
        if _rss_bytes(pid) > cap_bytes:
            over.set()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
