"""The peer watch's logic, on a store of this process (no process group): a peer that stops
beating is named after `peer_timeout_s`, a published failure at the next beat, a store that fails
or stops answering at once or after the timeout, a peer that finished is no loss, and the main
thread that claims the loss stops the run itself (the watch does not end the process)."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lit_grpo.loop import peers
from lit_grpo.loop.peers import PeerWatch, is_communication_error

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _forget_losses():
    """The losses these watches name are not this process's: `lost_a_peer` would end it hard at exit."""
    yield
    peers._LOST.clear()


class Exits:
    """Stands in for `os._exit`: records the code and when."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def watch(store, rank=0, world=2, *, timeout_s=1.5, children=None) -> tuple[PeerWatch, Exits]:
    exits = Exits()
    w = PeerWatch(
        store,
        rank,
        world,
        heartbeat_s=0.1,
        timeout_s=timeout_s,
        store_address="127.0.0.1:1",
        last_saved=lambda: "the last saved checkpoint is step 7",
        children=children,
        exit=exits,
    )
    return w, exits


def beat(store, rank: int, stop: threading.Event) -> threading.Thread:
    def loop():
        while not stop.wait(0.1):
            store.add(f"beat.{rank}", 1)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def hash_store() -> dist.HashStore:
    return dist.HashStore()


def test_a_beating_peer_is_never_reported_and_a_silent_one_is_named_after_the_timeout():
    store, stop = hash_store(), threading.Event()
    store.set("host.1", "train-1 (pid 42)")
    beat(store, 1, stop)
    w, exits = watch(store)
    w.start()
    assert not exits.done.wait(2.5), w.lost  # a second past the timeout: the peer beats, nothing reported
    stop.set()
    silenced = time.monotonic()
    assert exits.done.wait(10)
    waited = time.monotonic() - silenced
    assert 1.5 <= waited < 1.5 + 2.0 + 5.0 + 1.0  # the timeout, a clock tick, the handover to the main thread, slack
    assert exits.codes == [2]
    assert re.match(r"rank 1 \(train-1 \(pid 42\)\) sent no heartbeat for \d+ s", w.lost), w.lost
    assert "guards.peer_timeout_s=1.5" in w.lost
    assert w.lost.endswith("Rank 0 stops; the last saved checkpoint is step 7")
    w.close()


def test_a_failure_published_by_a_peer_is_seen_at_the_next_beat_with_its_message():
    store, stop = hash_store(), threading.Event()
    beat(store, 1, stop)
    store.set("host.1", "train-1 (pid 42)")
    w, exits = watch(store, timeout_s=30)
    w.start()
    store.set("failed.1", "checkpoint step_00000004 could not be written (No space left on device)")
    assert w._found.wait(2)  # one beat, not the 30 s timeout
    assert w.lost.startswith("rank 1 (train-1 (pid 42)) stopped with an error: checkpoint step_00000004")
    assert w.claim(0) == w.lost  # the main thread takes the stop over: the watch does not end the process
    time.sleep(0.3)
    assert not exits.codes
    stop.set()
    w.close()


def test_a_peer_that_finished_is_not_lost():
    store = hash_store()
    store.add("beat.1", 1)
    store.set("done.1", "1")
    w, exits = watch(store)
    w.start()
    assert not exits.done.wait(3), w.lost
    w.close()


def test_publish_failure_and_close_write_what_the_other_ranks_read():
    store = hash_store()
    w, _ = watch(store, timeout_s=30)
    w.start()
    w.publish_failure("boom")
    assert store.get("failed.0") == b"boom"
    w.close()
    assert store.get("done.0") == b"1"
    w.publish_failure("after the end")  # a closed watch publishes nothing more
    assert store.get("failed.0") == b"boom"


def test_a_store_whose_host_is_gone_is_reported_at_once():
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch.distributed as d, time; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
            "wait_for_workers=False); print(s.port, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        client.add("beat.1", 1)
        w, exits = watch(client, timeout_s=30)
        w.start()
        time.sleep(0.5)
        server.kill()
        server.wait()
        killed = time.monotonic()
        assert w._found.wait(5)
        assert time.monotonic() - killed < 5
        assert w.lost.startswith("the rendezvous store at 127.0.0.1:1 stopped answering")
    finally:
        server.kill()


def test_a_launched_rank_killed_is_named_with_its_signal_and_the_others_are_ended():
    dead = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store = hash_store()
    w, exits = watch(store, world=3, timeout_s=30, children={1: dead, 2: alive})
    for rank in (1, 2):
        store.add(f"beat.{rank}", 1)
    w.start()
    assert exits.done.wait(10)
    assert w.lost.startswith(f"rank 1 (pid {dead.pid}) ended with SIGKILL")
    assert alive.wait(5) == -9  # ended with the launching rank: nothing left running


@pytest.mark.parametrize(
    "text, lost",
    [
        ("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:45446: Connection reset by peer", True),
        ("Connection closed by peer [10.231.0.11]:29500", True),
        ("CUDA out of memory", False),
    ],
)
def test_communication_errors_are_told_from_others_through_the_chain(text, lost):
    assert is_communication_error(RuntimeError(text)) is lost
    wrapped = ValueError("in a barrier")
    wrapped.__cause__ = RuntimeError(text)
    assert is_communication_error(wrapped) is lost
    assert not is_communication_error(ValueError(text))  # only what torch raises (RuntimeError and its kin)


def test_after_a_reset_the_peer_that_stopped_beating_is_named_within_three_heartbeats():
    store, stop_1, stop_2 = hash_store(), threading.Event(), threading.Event()
    store.set("host.1", "train-1 (pid 42)")
    beat(store, 1, stop_1)
    beat(store, 2, stop_2)
    w, exits = watch(store, world=3, timeout_s=30)
    w.start()
    time.sleep(0.5)
    stop_1.set()  # rank 1 dies; rank 2 goes on beating
    time.sleep(0.15)
    asked = time.monotonic()
    reason = w.claim(40, "Connection reset by peer")
    assert time.monotonic() - asked < 3 * 0.1 + 1.0 + 0.5  # three heartbeats and a clock tick, not the 30 s timeout
    assert reason.startswith(
        "rank 1 (train-1 (pid 42)) is gone: a collective with it failed (Connection reset by peer) and it sent no "
        "heartbeat since. Rank 0 stops"
    ), reason
    assert not exits.codes
    stop_2.set()
    w.close()
