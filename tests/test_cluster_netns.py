"""The cluster rehearsal's ground floor (`benchmarks/cluster/netns.py`): network namespaces standing in
for hosts. Nodes reach each other over the bridge and nothing else; torchrun launched on two nodes the
way users launch it on a cluster (c10d rendezvous, and the static one) meets and all-reduces over gloo,
and with one hostname shared by the nodes c10d fails as on such a cluster and meets with the flags that
fix it; teardown leaves nothing behind, whether the body ends, raises, or the driver gets SIGINT or
SIGTERM (and `cleanup_leftovers` after a SIGKILL), and stops a running torchrun with its workers on every
node; a link set down stalls connections and set up restores them.

Root and `ip netns` are needed: skipped with the reason elsewhere. Every process is tiny (a socket, a
one-float all-reduce, `sleep`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not in the installed package
from benchmarks.cluster.netns import (  # noqa: E402
    NETNS_ETC,
    Cluster,
    available,
    cleanup_leftovers,
    main,
    probe_command,
)

PY = sys.executable
pytestmark = pytest.mark.slow

# Answers every connection with "pong <hostname>" until its deadline.
SERVER = """
import socket, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("0.0.0.0", int(sys.argv[1])))
listener.listen()
listener.settimeout(0.5)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        continue
    conn.sendall(f"pong {socket.gethostname()}".encode())
    conn.close()
"""

# Connects to host:port (each try bounded by `attempt_s`) until a reply or `total_s`; prints one line.
CLIENT = """
import socket, sys, time
host, port, attempt_s, total_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
start = time.monotonic()
while True:
    tried = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=attempt_s) as conn:
            conn.settimeout(attempt_s)
            print(f"reply {conn.recv(100).decode()} after {time.monotonic() - start:.2f}s", flush=True)
            break
    except OSError as exc:
        if time.monotonic() - start >= total_s:
            print(f"failed {type(exc).__name__} errno={exc.errno} after {time.monotonic() - tried:.2f}s", flush=True)
            break
        time.sleep(0.1)
"""


@pytest.fixture(autouse=True)
def _needs_network_namespaces():
    reason = available()
    if reason:
        pytest.skip(reason)


def _connect(cluster: Cluster, src: str, dst: str, port: int, attempt_s: float, total_s: float) -> str:
    argv = [PY, "-c", CLIENT, dst, str(port), str(attempt_s), str(total_s)]
    return cluster.run(src, argv, timeout_s=total_s + attempt_s + 15).stdout.strip()


def _serve(cluster: Cluster, node: str, port: int, seconds: float = 90) -> subprocess.Popen:
    return cluster.popen(node, [PY, "-c", SERVER, str(port), str(seconds)], label="server")


def _leftovers(token: str) -> list[str]:
    """Whatever of the run `token` is still on the machine: namespaces, /etc/netns folders, host links."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    found = [f"netns {n}" for n in names if n.startswith(f"{token}-")]
    if NETNS_ETC.is_dir():
        found += [f"/etc/netns/{p.name}" for p in NETNS_ETC.iterdir() if p.name.startswith(f"{token}-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    found += [f"link {line}" for line in links.splitlines() if token in line]
    return found


def _running(pids: list[int]) -> list[int]:
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    return [pid for pid in pids if alive(pid)]


def _namespace_pids(cluster: Cluster) -> list[int]:
    pids = []
    for namespace in cluster.namespace_names():
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10).stdout
        pids += [int(word) for word in out.split()]
    return pids


@pytest.mark.timeout(120)
def test_nodes_reach_each_other_by_name_over_the_bridge_and_nothing_outside_it(tmp_path):
    host_addresses = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    outside = [line.split()[3].split("/")[0] for line in host_addresses.splitlines() if " lo " not in line]
    with Cluster(log_dir=tmp_path) as cluster:  # train-0, train-1, infer-0, infer-1
        _serve(cluster, "train-1", 29611)
        for client in ("train-0", "infer-1"):
            reply = _connect(cluster, client, "train-1", 29611, attempt_s=2, total_s=30)
            assert reply.startswith("reply pong train-1"), (client, reply)
        # The host's own addresses and the wide world are not routed from a node: refused at once.
        for address in [*outside, "8.8.8.8"]:
            result = _connect(cluster, "train-0", address, 22, attempt_s=5, total_s=0)
            assert result.startswith("failed OSError errno=101"), (address, result)  # ENETUNREACH
            assert float(result.rsplit(" ", 1)[1].rstrip("s")) < 1.0, result


def _start_torchrun_probe(
    cluster: Cluster, launch: str, env: dict[str, str], extra=lambda rank, node: ()
) -> list[subprocess.Popen]:
    """The all-reduce probe's torchrun command, as docs/guides/multi-node.md shows it, on train-0 and
    train-1 (`extra(rank, node)`: flags added on that node)."""
    env = {
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(PY).parent}{os.pathsep}{os.environ['PATH']}",  # `torchrun` is this interpreter's
        "OMP_NUM_THREADS": "1",
        "LIT_GRPO_PROBE_TIMEOUT_S": "60",
        **env,
    }
    return [
        cluster.popen(node, probe_command(launch, rank, extra=tuple(extra(rank, node))), env=env, cwd=REPO)
        for rank, node in enumerate(("train-0", "train-1"))
    ]


def _torchrun_probe(cluster: Cluster, launch: str, env: dict[str, str], extra=lambda rank, node: ()):
    """The probe run to its end: exit codes and logs."""
    procs = _start_torchrun_probe(cluster, launch, env, extra)
    codes = cluster.wait(procs, timeout_s=120)
    return codes, [cluster.log(proc) for proc in procs]


def _sums(logs: list[str]) -> list[str]:
    lines = sorted(line for log in logs for line in log.splitlines() if line.startswith("allreduce "))
    return [line.split(" master=")[0] for line in lines]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launch", ["c10d", "static"])
def test_torchrun_on_two_nodes_meets_and_all_reduces_over_gloo(launch, tmp_path):
    with Cluster(("train-0", "train-1"), log_dir=tmp_path) as cluster:
        codes, logs = _torchrun_probe(cluster, launch, {})
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    lines = _sums(logs)
    assert [line.split(" host=")[0] for line in lines] == [
        "allreduce rank=0 world=2 sum=1",
        "allreduce rank=1 world=2 sum=1",
    ], logs
    hosts = [line.split(" host=")[1] for line in lines]
    # Static: --node-rank=0 is train-0. c10d ranks the nodes itself: either may be rank 0.
    assert (hosts if launch == "static" else sorted(hosts)) == ["train-0", "train-1"], logs


@pytest.mark.timeout(150)
def test_the_command_line_health_check_and_cleanup(tmp_path, capsys):
    assert main(["probe", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train-0: exit 0\n  allreduce rank=" in out and "train-1: exit 0\n  allreduce rank=" in out, out
    assert out.count(" sum=1 ") == 2, out
    assert main(["cleanup"]) == 0


@pytest.mark.timeout(150)
def test_with_one_hostname_shared_by_the_nodes_c10d_needs_is_host_local_addr_and_gloo_socket_ifname(tmp_path):
    # Every node keeps the machine's hostname, which /etc/hosts maps to 127.0.0.1 (`ip netns exec`'s
    # default). Plain c10d: no node takes itself for the endpoint's host, so nobody serves the store and
    # every node's client times out (read_timeout=5 here, 60 s by default).
    with Cluster(("train-0", "train-1"), log_dir=tmp_path / "plain", own_hostnames=False) as cluster:
        codes, logs = _torchrun_probe(cluster, "c10d", {}, lambda rank, node: ["--rdzv-conf=read_timeout=5"])
    assert codes[0] != 0 and codes[1] != 0, logs
    for log in logs:
        assert "The connection to the C10d store has failed" in log, log[-3000:]
        assert "while trying to connect to (train-0, 29400)" in log, log[-3000:]  # train-0 too was a client

    # The three settings that make it meet (netns.py's docstring says why each).
    def fixed(rank: int, node: str) -> list[str]:
        return [f"--rdzv-conf=is_host={int(node == 'train-0')}", f"--local-addr={cluster.address(node)}"]

    with Cluster(("train-0", "train-1"), log_dir=tmp_path / "fixed", own_hostnames=False) as cluster:
        codes, logs = _torchrun_probe(cluster, "c10d", {"GLOO_SOCKET_IFNAME": "eth0"}, fixed)
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    assert [line.split(" host=")[0] for line in _sums(logs)] == [
        "allreduce rank=0 world=2 sum=1",
        "allreduce rank=1 world=2 sum=1",
    ], logs


@pytest.mark.timeout(150)
def test_teardown_stops_torchrun_and_its_workers_on_every_node_with_sigterm(tmp_path):
    with Cluster(("train-0", "train-1"), log_dir=tmp_path, kill_grace_s=20) as cluster:
        procs = _start_torchrun_probe(cluster, "c10d", {"LIT_GRPO_PROBE_HOLD_S": "300"})
        deadline = time.monotonic() + 90
        while not all("allreduce " in cluster.log(proc) for proc in procs):
            assert all(proc.poll() is None for proc in procs), [cluster.log(proc)[-2000:] for proc in procs]
            assert time.monotonic() < deadline, [cluster.log(proc)[-2000:] for proc in procs]
            time.sleep(0.2)
        pids = _namespace_pids(cluster)
        assert len(pids) == 4, pids  # an agent and its worker (a session of its own) on each node
        leaving = time.monotonic()
    took = time.monotonic() - leaving
    assert not _running(pids) and not _leftovers(cluster.token)
    assert took < 15, took  # SIGTERM was enough: nothing waited for the SIGKILL after 20 s
    for proc in procs:
        assert "closing signal SIGTERM" in cluster.log(proc), cluster.log(proc)[-2000:]


def _start_sleepers(cluster: Cluster) -> list[int]:
    """A sleeper on each node, one with a child in the same group and one that left it (setsid)."""
    for node in cluster.nodes:
        cluster.popen(node, ["sh", "-c", "setsid sleep 300 & sleep 300 & wait"], label="sleepers")
    deadline = time.monotonic() + 10
    while len(pids := _namespace_pids(cluster)) < 3 * len(cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 3 * len(cluster.nodes), pids
    return pids


@pytest.mark.timeout(60)
def test_teardown_leaves_nothing_when_the_body_ends_or_raises(tmp_path):
    with Cluster(("train-0", "infer-0"), log_dir=tmp_path / "ends") as cluster:
        pids = _start_sleepers(cluster)
        assert len(_leftovers(cluster.token)) == 5  # 3 namespaces, 2 /etc/netns folders
    assert not _leftovers(cluster.token) and not _running(pids)

    with pytest.raises(RuntimeError, match="the body failed"):
        with Cluster(("train-0", "infer-0"), log_dir=tmp_path / "raises") as cluster:
            pids = _start_sleepers(cluster)
            raise RuntimeError("the body failed")
    assert not _leftovers(cluster.token) and not _running(pids)


DRIVER = """
import sys, time
from benchmarks.cluster.netns import Cluster
with Cluster(("train-0", "train-1"), log_dir=sys.argv[1]) as cluster:
    for node in cluster.nodes:
        cluster.popen(node, ["sh", "-c", "setsid sleep 300 & sleep 300 & wait"])
    print("ready", cluster.token, flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_teardown_when_the_driver_is_signalled(sig, tmp_path):
    driver = subprocess.Popen(
        [PY, "-c", DRIVER, str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = driver.stdout.readline()  # bounded by the test's timeout
        assert line.startswith("ready "), driver.stderr.read() if driver.poll() is not None else line
        token = line.split()[1]
        cluster = Cluster(("train-0", "train-1"), token=token)  # names only: it is not entered
        deadline = time.monotonic() + 10
        while len(pids := _namespace_pids(cluster)) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pids) == 6, pids
        driver.send_signal(sig)
        driver.wait(timeout=30)
        if sig == signal.SIGKILL:  # no teardown could run: what cleanup_leftovers is for
            assert _leftovers(token) and _running(pids)
            assert set(cluster.namespace_names()) <= set(cleanup_leftovers())  # with any other dead run's
        deadline = time.monotonic() + 10  # a SIGKILLed process is gone once the kernel reaps it
        while (_running(pids) or _leftovers(token)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _leftovers(token), _leftovers(token)
        assert not _running(pids), _running(pids)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)


@pytest.mark.timeout(120)
def test_a_link_set_down_stalls_connections_until_it_is_set_up(tmp_path):
    with Cluster(("train-0", "train-1"), log_dir=tmp_path) as cluster:
        _serve(cluster, "train-1", 29612)
        assert _connect(cluster, "train-0", "train-1", 29612, attempt_s=2, total_s=30).startswith("reply pong")

        cluster.link_down("train-1")
        result = _connect(cluster, "train-0", "train-1", 29612, attempt_s=2, total_s=0)
        # Dropped on the wire, not refused: a timeout (or "no route to host" once the node's ARP gives up).
        assert result.startswith(("failed TimeoutError", "failed OSError errno=113")), result
        cluster.link_up("train-1")
        assert _connect(cluster, "train-0", "train-1", 29612, attempt_s=2, total_s=30).startswith("reply pong")

        # Down for 3 s, then back by itself: a client retrying all along gets through after it.
        cluster.link_down("train-1", seconds=3)
        result = _connect(cluster, "train-0", "train-1", 29612, attempt_s=1, total_s=30)
        assert result.startswith("reply pong train-1"), result
        assert float(result.rsplit(" ", 1)[1].rstrip("s")) >= 2.5, result
