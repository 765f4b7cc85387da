"""A lost peer stops every rank within seconds: heartbeats in the process group's store.

A rank blocked in a collective cannot be interrupted from Python, and a collective over TCP learns
of a dead peer only when the peer's kernel resets the connection: a peer on another host that loses
power or its link sends nothing, and the others would wait out the collective's timeout
(`guards.collective_timeout_s`, 30 minutes by default in torch). So each rank runs `PeerWatch`, two
daemon threads beside training:

- the beat: every `guards.peer_heartbeat_s` it adds 1 to its own counter in the rendezvous store
  (the `TCPStore` at `MASTER_ADDR:MASTER_PORT` that torchrun's agent or Lightning's rank 0 hosts,
  reached by a connection of its own) and reads every other rank's counter and failure note;
- the clock: every second it checks that a peer's counter moved within `guards.peer_timeout_s` (by
  this host's clock alone: no clock is compared across hosts) and that the store answered within it.

A rank whose peer stopped beating, published a failure (`publish_failure`, from Lightning's
`on_exception`), or whose store stopped answering, prints one `error:` line naming the rank, its
host and the last saved checkpoint, and exits with status 2 (an environment fault) without waiting
for its collective. Worst-case detection: `peer_timeout_s + peer_heartbeat_s` for a peer that went
silent, `peer_heartbeat_s` for one that failed with an error. The main thread, when its collective
fails first (a reset on one host), asks the watch who was lost (`explain_lost_peer`) and stops
with the same line.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import lightning as L

from lit_grpo.errors import EXIT_USER_ERROR, EnvironmentFault, user_message
from lit_grpo.loop.distributed import WatchedLauncher
from lit_grpo.loop.signals import StopRequested
from lit_grpo.run.checkpoint import run_id_of

log = logging.getLogger(__name__)
KEY_PREFIX = "lit_grpo.peers"
CLOCK_TICK_S = 1.0
HANDOVER_S = 5.0
"""How long the watch waits for the main thread to stop the run itself once a peer is lost, before
the process exits from the watch's thread (the main thread is then stuck in a collective)."""
COMMUNICATION_ERRORS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
    "timed out",
    "Timed out",
    "Failed to recv",
    "Connection was likely closed",
)
"""What gloo, c10d and the store say when the other end of a collective went away."""


class PeerLost(EnvironmentFault):
    """Another rank of the run stopped (killed, its host down, its link cut) or failed."""


def communication_failure(err: BaseException) -> Optional[str]:
    """What went wrong (`Connection reset by peer`, ...) when `err` (or an error it chains) is a
    collective or store call failing because a peer went away, else None."""
    seen: set[int] = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError):
            for text in COMMUNICATION_ERRORS:
                if text in str(e):
                    return text
        e = e.__cause__ or e.__context__
    return None


def is_communication_error(err: BaseException) -> bool:
    return communication_failure(err) is not None


class PeerWatch:
    """This rank's heartbeat and its watch over the others' (see the module's docstring).

    `store` is a `torch.distributed.Store` of this watch's own (its calls block: not the process
    group's). `last_saved` returns the last checkpoint this rank saved (for the message); `exit`
    ends the process (tests replace it).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        heartbeat_s: float,
        timeout_s: float,
        store_address: str,
        store_host: str = "the node that hosts it",
        last_saved: Callable[[], str],
        children: Optional[dict[int, subprocess.Popen]] = None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.children = children or {}
        """The ranks this process launched (Lightning's launcher: rank 0 starts the other local ranks)."""
        self._child_ended_at: dict[int, float] = {}
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.store_address, self.store_host = store_address, store_host
        self.last_saved, self._exit = last_saved, exit
        self.lost: Optional[str] = None
        """Why the run cannot go on (set once, by the watch): the peer and what happened to it."""
        self._found = threading.Event()
        self._claimed = threading.Event()
        self._closed = threading.Event()
        self._beats: dict[int, int] = {}
        self._moved_at: dict[int, float] = {}
        self._hosts: dict[int, str] = {}
        self._peer_done = False
        self._lock = threading.Lock()
        self._exiting = False
        self._store_answered_at = time.monotonic()

    def start(self) -> PeerWatch:
        now = time.monotonic()
        self._moved_at = {r: now for r in self.peers}
        self._store_answered_at = now
        self.store.set(f"host.{self.rank}", f"{socket.gethostname()} (pid {os.getpid()})")
        for name, target in (("peer-beat", self._beat_loop), ("peer-clock", self._clock_loop)):
            threading.Thread(target=target, name=name, daemon=True).start()
        return self

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def close(self) -> None:
        """Stop watching (the run ended, or is ending): a peer that exits after this is not a loss."""
        self._closed.set()
        try:
            self.store.set(f"done.{self.rank}", "1")
        except Exception:  # the store's host may have ended first: nothing left to tell
            pass

    def publish_failure(self, message: str) -> None:
        """Tell the other ranks that this one stopped with an error (they stop at their next beat)."""
        if self._closed.is_set():
            return
        try:
            self.store.set(f"failed.{self.rank}", message[:2000])
        except Exception:  # the store is gone: the others see this rank's beat stop instead
            pass

    def stand_down(self) -> None:
        """This rank is stopping on its own (its error or a stop signal): the watch no longer ends the process."""
        self._closed.set()

    def claim(self, wait_s: float, error: str = "") -> Optional[str]:
        """Called by the main thread whose collective failed (`error`, its first line): wait up to
        `wait_s` for the watch to name the lost peer; then it is the main thread's to stop the run
        (the watch will not exit the process). The reason, or None when no peer was found lost.

        A collective that failed with a reset was cut by a peer that is gone: the peers whose counter
        has not moved for 3 heartbeats after it are that peer, named without waiting for the timeout."""
        failed_at = time.monotonic()
        found = self._found.wait(min(wait_s, 3 * self.heartbeat_s + CLOCK_TICK_S))
        if not found:
            silent = [r for r in self.peers if self._moved_at[r] < failed_at]
            if silent and not self._closed.is_set():
                rank = silent[0]
                self._name_lost(
                    f"rank {rank} ({self._hosts.get(rank, 'host unknown')}) is gone: a collective with it failed "
                    f"({error}) and it sent no heartbeat since"
                )
            found = self._found.wait(max(0.0, wait_s - (time.monotonic() - failed_at)))
        with self._lock:
            if self._exiting:  # too late: the watch is ending the process with this message
                threading.Event().wait()
            self._claimed.set()
        return self.lost if found else None

    def _host(self, rank: int) -> str:
        if rank not in self._hosts:
            try:
                if self.store.check([f"host.{rank}"]):
                    self._hosts[rank] = self.store.get(f"host.{rank}").decode()
            except Exception:
                pass
        return self._hosts.get(rank, "host unknown")

    def _beat_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.store.add(f"beat.{self.rank}", 1)
                for rank in self.peers:
                    if rank not in self._hosts:
                        self._host(rank)  # for the message, while its host can still be asked
                    beat = self.store.add(f"beat.{rank}", 0)  # adding 0 reads without blocking on a missing key
                    if beat != self._beats.get(rank):
                        self._beats[rank] = beat
                        self._moved_at[rank] = time.monotonic()
                    if self.store.check([f"failed.{rank}"]):
                        note = self.store.get(f"failed.{rank}").decode()
                        self._report(f"rank {rank} ({self._host(rank)}) stopped with an error: {note}")
                        return
                    if self.store.check([f"done.{rank}"]):  # it finished: its silence from now on is no loss
                        self._moved_at[rank] = float("inf")
                        self._peer_done = True
                self._store_answered_at = time.monotonic()
            except Exception as err:
                if self._closed.is_set() or self._peer_done:  # the run is ending: the store's host went first
                    return
                self._report(
                    f"the rendezvous store at {self.store_address} stopped answering ({_first_line(err)}): "
                    f"{self.store_host} is gone or unreachable"
                )
                return
            self._closed.wait(self.heartbeat_s)

    def _clock_loop(self) -> None:
        while not self._closed.wait(CLOCK_TICK_S):
            now = time.monotonic()
            for rank, proc in self.children.items():
                code = proc.poll()
                if code in (None, 0):
                    continue
                # An exit with a code of its own: its failure note says more (the beat reads it); a signal: now.
                ended = self._child_ended_at.setdefault(rank, now)
                if code < 0 or now - ended > 2 * self.heartbeat_s:
                    self._report(f"rank {rank} (pid {proc.pid}) ended with {_exit_status(code)}")
                    return
            # The store first: a node cut off hears from no peer either, and it is the store it lost.
            if now - self._store_answered_at > self.timeout_s and not self._peer_done:
                self._report(
                    f"the rendezvous store at {self.store_address} did not answer for "
                    f"{now - self._store_answered_at:.0f} s (guards.peer_timeout_s={self.timeout_s:g}): this node "
                    f"lost its network, or {self.store_host} is down",
                    cut_off=True,
                )
                return
            # A peer is silent only while the store answers: a node cut off from the store sees every
            # peer stop too, and must name the store (above), not a peer, once its own timeout is up.
            silent = [r for r in self.peers if self._store_answered_at - self._moved_at[r] > self.timeout_s]
            if silent:
                rank = silent[0]
                self._report(
                    f"rank {rank} ({self._hosts.get(rank, 'host unknown')}) sent no heartbeat for "
                    f"{now - self._moved_at[rank]:.0f} s (guards.peer_timeout_s={self.timeout_s:g}): it was killed, "
                    "its node went down or its network is cut"
                )
                return

    def _name_lost(self, what: str) -> bool:
        """Record why the run cannot go on, once; False when it was recorded already (or the watch is closed)."""
        with self._lock:
            if self._found.is_set() or self._closed.is_set():
                return False
            self.lost = f"{what.rstrip('.')}. Rank {self.rank} stops; {self.last_saved()}"
            _LOST.append(self.lost)
            self._found.set()
            return True

    def _report(self, what: str, cut_off: bool = False) -> None:
        """The run cannot go on: say why once; exit unless the main thread takes the stop over.
        `cut_off`: this node lost the store; its torchrun agent goes too (`end_torchrun_agent`)."""
        if not self._name_lost(what):
            return
        if self._claimed.wait(HANDOVER_S):
            return  # the main thread stops the run with this message
        with self._lock:
            if self._claimed.is_set():
                return
            self._exiting = True
        log.error("stopped: PeerLost (its message follows)")
        print(f"error: {self.lost}", file=sys.stderr, flush=True)
        end_children(self.children.values())
        if cut_off:
            end_torchrun_agent()
        logging.shutdown()
        sys.stdout.flush()
        self._exit(EXIT_USER_ERROR)


def end_torchrun_agent() -> None:
    """SIGKILL this worker's torchrun agent (its parent), if it is one. On a node cut off from the
    rendezvous store the agent, once its worker ended, waits for the store until the network comes
    back (seen: until the link came back 90 s later, whatever its read timeout): the node's job then
    never ends. The agent has nothing left to do there but report its worker's failure."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()
    try:
        command = open(f"/proc/{agent}/cmdline", "rb").read().replace(b"\0", b" ")
    except OSError:
        return
    if b"torchrun" in command or b"torch.distributed.run" in command:
        log.warning("ending this node's torchrun agent (pid %d): it cannot reach the store either", agent)
        os.kill(agent, signal.SIGKILL)


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def end_children(children) -> None:
    """SIGKILL the ranks this process launched that are still running (they may be blocked in a
    collective, where SIGTERM is not acted on), and reap them."""
    for proc in children:
        if proc.poll() is None:
            proc.kill()
    for proc in children:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


_active: Optional[PeerWatch] = None
_LOST: list[str] = []
"""Every loss a watch of this process named (the process group it ran on is broken)."""


def active_watch() -> Optional[PeerWatch]:
    """The watch of the run in progress in this process, if it is distributed."""
    return _active


def start_watch(
    rank: int,
    world_size: int,
    *,
    heartbeat_s: float,
    timeout_s: float,
    last_saved: Callable[[], str],
    children: Optional[dict[int, subprocess.Popen]] = None,
) -> Optional[PeerWatch]:
    """Start this process's watch over the other ranks (none when `timeout_s` is 0 or the store's
    address is not in the environment, as torchrun and Lightning's launcher put it)."""
    global _active
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if timeout_s <= 0 or world_size < 2 or not address or not port:
        return None
    import torch.distributed as dist

    # A store or collective call to a lost peer makes torch's C++ side print a warning with its stack
    # frames before Python sees the error: the stop's message says what happened, once.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    client = dist.TCPStore(
        address,
        int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{KEY_PREFIX}/{run}", client)
    _active = PeerWatch(
        store,
        rank,
        world_size,
        heartbeat_s=heartbeat_s,
        timeout_s=timeout_s,
        store_address=f"{address}:{port}",
        store_host="node 0's torchrun agent, which hosts it," if elastic else "rank 0, which hosts it,",
        last_saved=last_saved,
        children=children,
    ).start()
    return _active


def lost_a_peer() -> bool:
    """Whether a run of this process stopped because a peer was lost (its process group is broken)."""
    return bool(_LOST)


def stop_watch() -> None:
    global _active
    if _active is not None:
        _active.close()
        _active = None


def explain_lost_peer(err: BaseException) -> Optional[PeerLost]:
    """For an error of the main thread: a `PeerLost` naming the lost rank when `err` is a collective
    that failed because a peer went away (waiting for the watch to tell which), else None."""
    watch = _active
    if watch is None or not is_communication_error(err):
        return None
    reason = watch.claim(watch.timeout_s + 2 * watch.heartbeat_s, communication_failure(err) or "")
    if reason is None:
        return PeerLost(
            f"a collective failed ({_first_line(err)}), and no rank was found lost within "
            f"{watch.timeout_s + 2 * watch.heartbeat_s:.0f} s. Rank {watch.rank} stops; {watch.last_saved()}"
        )
    return PeerLost(reason)


def last_saved_line(module: L.LightningModule) -> str:
    """Where `resume=auto` continues from, for a stop's message."""
    sequence = getattr(module, "step_sequence", None)
    checkpointer = sequence.checkpointer if sequence is not None else None
    if checkpointer is None:
        return "checkpoints are off (checkpoint.save_interval=0): a relaunch starts over"
    # Rank 0 may have published a step whose last barrier this rank never left: the folder tells.
    published = [s for s, path in checkpointer.store.step_dirs() if run_id_of(path) == checkpointer.run_id]
    last = max([*published, checkpointer.last_saved_step or 0])
    if not last:
        return "no checkpoint was saved yet: a relaunch starts over"
    return f"the last saved checkpoint is step {last}: relaunch every node with resume=auto to continue from it"


class PeerWatchCallback(L.Callback):
    """Starts this rank's `PeerWatch` once the process group exists, tells the other ranks when this
    one fails, and stops watching when the run ends."""

    def __init__(self, heartbeat_s: float, timeout_s: float) -> None:
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        launcher = trainer.strategy.launcher
        procs = launcher.procs if isinstance(launcher, WatchedLauncher) else []
        start_watch(
            trainer.global_rank,
            trainer.world_size,
            heartbeat_s=self.heartbeat_s,
            timeout_s=self.timeout_s,
            last_saved=lambda: last_saved_line(pl_module),
            children={trainer.global_rank + 1 + i: proc for i, proc in enumerate(procs)},
        )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        watch = active_watch()
        if watch is None or is_communication_error(exception):
            return  # a lost peer: `explain_lost_peer` names it
        if not isinstance(exception, (StopRequested, PeerLost)):  # a stop signal reaches every rank by itself
            watch.publish_failure(user_message(exception) or f"{type(exception).__name__}: {_first_line(exception)}")
        watch.stand_down()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        stop_watch()
