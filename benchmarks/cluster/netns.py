"""Several hosts on one Linux machine: one network namespace per node, all on one bridge.

The cluster rehearsal launches trainer and inference processes across these "nodes" with the very
commands a user runs on a real cluster (torchrun, `python -m lit_grpo.serve`), so the launch paths the
docs give are the ones tested. Layout of a `Cluster` whose token is `lgr<pid>` (the driver's pid):

    namespace lgr<pid>-switch      the bridge `lgr<pid>br` and one port `lgr<pid>p<i>` per node
    namespace lgr<pid>-<node>      lo, and `eth0` (the other end of port i) with address 10.231.0.<10+i>/24
    /etc/netns/lgr<pid>-<node>/hosts   every node's name -> its address, then the machine's own
                                       /etc/hosts (`ip netns exec` mounts it over /etc/hosts), so
                                       nodes resolve each other by name

Nothing is added to the host's own network namespace: the bridge and the veth pairs are created inside
the switch namespace (each pair's peer moved straight into its node), no namespace has a default route,
and no address lives outside the subnet. A node therefore reaches the other nodes and its own loopback,
and nothing else (a connection elsewhere fails at once: network unreachable).

Every process started with `Cluster.popen` runs in its node's namespace under the node's hostname (its
own UTS namespace, `unshare --uts`), in a process group of its own, with its output in a log file and
the node's own TMPDIR.

Why the distinct hostnames (found by experiment, torch 2.13): with every namespace keeping the machine's
hostname (here `vm`, which /etc/hosts maps to 127.0.0.1), torchrun's c10d rendezvous fails in three places:

1. No node hosts the rendezvous store. torchrun decides whether it hosts the store at `--rdzv-endpoint`
   by comparing the endpoint with its hostname and the addresses the hostname resolves to
   (`torch.distributed.elastic.rendezvous.utils._matches_machine_hostname`); `vm` resolves to 127.0.0.1,
   so even the node owning the endpoint's address is a client, and every node retries connecting to a
   store nobody listens on until the 60 s read timeout ("did not meet within 60 s").
2. The workers' store is unreachable. Each node advertises `--local-addr` or else `socket.getfqdn()`
   (`localhost` here) as its address; the node ranked 0 (any node, not necessarily the endpoint's) hosts
   the workers' TCP store and every worker gets MASTER_ADDR=<that address>, i.e. its own loopback.
3. gloo listens on loopback. Without GLOO_SOCKET_IFNAME gloo binds the address the hostname resolves to
   (127.0.0.1) and hands it to its peers: "Gloo connectFullMesh failed ... remote=[127.0.0.1]".

A shared hostname works with `--rdzv-conf=is_host=1` on the endpoint's node (`is_host=0` elsewhere),
`--local-addr=<the node's address>` on every node and GLOO_SOCKET_IFNAME=eth0 (verified). The static
rendezvous (`--master-addr/--master-port/--node-rank`) avoids 1 and 2 but still needs 3. With a distinct
hostname per node that resolves to the node's bridge address, as on a real cluster, the plain commands
work with no flag at all, which is what this module sets up (`own_hostnames=False` rehearses the other).
The static rendezvous with a shared hostname was seen to fail at 3; that it meets with GLOO_SOCKET_IFNAME
alone follows from the above but was not run. With own hostnames, torch still warns "The hostname of the
client socket cannot be retrieved. err=-3" (a reverse lookup that reaches for DNS, unreachable from a
node): harmless, the runs complete.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
NETNS_ETC = Path("/etc/netns")
TOKEN_STEM = "lgr"  # every token is `lgr<digits>`: short enough for 15-character interface names
COMMAND_TIMEOUT_S = 15.0  # one `ip` command; they take milliseconds
NODE_INTERFACE = "eth0"  # inside a node's own namespace, so it can neither collide nor outlive the node
DEFAULT_NODES = ("train-0", "train-1", "infer-0", "infer-1")


# Set by torchrun, SLURM or a user for the driver's own process; a node's launch sets its own.
LAUNCH_VARIABLES = re.compile(
    r"^(RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT"
    r"|TORCHELASTIC_.*|TORCH_ELASTIC_.*|GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME|TP_SOCKET_IFNAME|SLURM_.*)$"
)


def _inherited_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not LAUNCH_VARIABLES.match(k)}


class ClusterError(RuntimeError):
    """A namespace, link or process of the rehearsal could not be set up or torn down."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _namespaces() -> list[str]:
    """The machine's named network namespaces (`ip netns list`, first word of each line)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespace_pids(namespace: str) -> list[int]:
    """The processes inside `namespace`: those whose network namespace is the one /run/netns/<name> pins
    (what `ip netns pids` does, without a process per call)."""
    try:
        pinned = os.stat(f"/run/netns/{namespace}")
    except OSError:
        return []
    pids = []
    for entry in _proc_entries():
        try:
            ns = os.stat(entry / "ns" / "net")
        except OSError:
            continue
        if (ns.st_dev, ns.st_ino) == (pinned.st_dev, pinned.st_ino):
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _stop(procs: list[subprocess.Popen], namespaces: list[str], grace_s: float) -> None:
    """SIGTERM the process group of each of `procs` (each leads its own) and every process inside
    `namespaces`, then SIGKILL what is left after `grace_s`.

    The namespace sweep reaches what left its group: torchrun starts each worker in a session of its own
    (and forwards SIGTERM to it), a command may `setsid`. Waits at most `grace_s` + 5 s in all.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        for namespace in namespaces:
            for pid in _namespace_pids(namespace):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for proc in procs:
                proc.poll()  # reaps the leader, which would otherwise linger as a zombie
            if not any(_group_alive(proc.pid) for proc in procs) and not any(
                _alive(pid) for namespace in namespaces for pid in _namespace_pids(namespace)
            ):
                return
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that has not exited."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in _proc_entries():
        try:
            if os.getpgid(int(entry.name)) == pgid and _alive(int(entry.name)):
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def _proc_entries() -> list[Path]:
    return [p for p in Path("/proc").iterdir() if p.name.isdigit()]


def _remove_namespace(namespace: str) -> None:
    """Kill whatever still runs inside `namespace`, delete it and its /etc/netns folder."""
    for pid in _namespace_pids(namespace):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if namespace in _namespaces():
        _ip("netns", "delete", namespace, check=False)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def cleanup_leftovers(token: str | None = None) -> list[str]:
    """Remove the namespaces (with their processes, links and /etc/netns folders) of earlier runs.

    With `token` (e.g. `lgr4242`), everything of that run; without, everything of every run whose driver
    process is gone (the pid is part of the token), so a concurrent live run is left alone. Returns the
    namespaces removed. For a driver that died by SIGKILL, where no teardown could run.
    """
    pattern = re.compile(rf"^({TOKEN_STEM}(\d+))-")
    names = set(_namespaces())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    removed = []
    for name in sorted(names):
        match = pattern.match(name)
        if not match:
            continue
        if token is not None and match.group(1) != token:
            continue
        if token is None and _alive(int(match.group(2))):  # a live run, this process's own included
            continue
        removed.append(name)
    # Nodes before their switch, so no port is left dangling while its node is being removed.
    for name in sorted(removed, key=lambda n: n.endswith("-switch")):
        _remove_namespace(name)
    return removed


_AVAILABLE: str | None = None
_OPEN_TOKENS: set[str] = set()  # the tokens of this process's clusters that are up


def available() -> str:
    """Why network namespaces with veth pairs and a bridge cannot be made here (a test's skip reason), or
    the empty string when they can."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        _AVAILABLE = "network namespaces need Linux"
    elif os.geteuid() != 0:
        _AVAILABLE = "network namespaces need root"
    elif not (Path(IP).exists() and Path(UNSHARE).exists()):
        _AVAILABLE = f"needs `ip` (iproute2) and `unshare` (util-linux): {IP}, {UNSHARE}"
    else:
        probe = f"{TOKEN_STEM}{os.getpid()}-probe"
        try:
            _ip("netns", "add", probe)
            _ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1")
            _ip("-n", probe, "link", "add", "name", "probebr", "type", "bridge")
            # `ip netns exec` remounts /sys and /etc/hosts, which an unprivileged container refuses.
            subprocess.run(
                [IP, "netns", "exec", probe, UNSHARE, "--uts", "--", "hostname", "probe"],
                check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S,
            )  # fmt: skip
            _AVAILABLE = ""
        except subprocess.CalledProcessError as exc:
            _AVAILABLE = f"cannot run a command inside a network namespace here: {exc.stderr.decode().strip()}"
        except (ClusterError, OSError, subprocess.SubprocessError) as exc:
            _AVAILABLE = f"cannot make a network namespace with a veth pair and a bridge here: {exc}"
        finally:
            _remove_namespace(probe)
    return _AVAILABLE


@dataclass(frozen=True)
class Node:
    """One stand-in host: its name (also its hostname), address on the bridge, namespace and switch port."""

    name: str
    address: str
    namespace: str
    switch_port: str


@dataclass
class _Started:
    node: str
    proc: subprocess.Popen
    log_path: Path


class Cluster:
    """Named nodes on one bridge, each in its own network namespace; a context manager.

    Leaving the `with` block (normally, on an exception, on Ctrl-C) or the driver getting SIGTERM or
    SIGHUP stops every process group it started and every process inside its namespaces (SIGTERM, then
    SIGKILL after `kill_grace_s`), then deletes its namespaces (the links go with them) and /etc/netns
    folders; the logs stay (`log_dir`, a temporary folder by default). `cleanup_leftovers()` is for a
    driver killed outright.

    Node i gets address `<subnet>.<10 + i>`. `token` (default `lgr<pid>`) names everything the cluster
    makes; one process holding two clusters at once gives the second its own. `own_hostnames=False`
    leaves every node the machine's hostname (the setup where c10d does not meet without flags: see the
    module's docstring).
    """

    def __init__(
        self,
        nodes: tuple[str, ...] | list[str] = DEFAULT_NODES,
        *,
        log_dir: Path | str | None = None,
        subnet: str = "10.231.0",
        token: str | None = None,
        kill_grace_s: float = 5.0,
        own_hostnames: bool = True,
    ) -> None:
        self.token = token or f"{TOKEN_STEM}{os.getpid()}"
        if not re.fullmatch(rf"{TOKEN_STEM}\d{{1,9}}", self.token):
            raise ValueError(f"token {self.token!r}: must be {TOKEN_STEM}<digits> (interface names are 15 chars)")
        if len(set(nodes)) != len(nodes) or not nodes:
            raise ValueError(f"node names must be distinct, and at least one: {nodes}")
        for name in nodes:
            if not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", name):
                raise ValueError(f"node name {name!r}: lower-case letters, digits and dashes (it is a hostname)")
        self.nodes = {
            name: Node(name, f"{subnet}.{10 + i}", f"{self.token}-{name}", f"{self.token}p{i}")
            for i, name in enumerate(nodes)
        }
        self.switch = f"{self.token}-switch"
        self.bridge = f"{self.token}br"
        self.log_dir = Path(log_dir) if log_dir is not None else None  # a temporary folder once entered
        self.kill_grace_s = kill_grace_s
        self.own_hostnames = own_hostnames
        self._started: list[_Started] = []
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()
        self._closed = True
        self._previous_handlers: dict[int, object] = {}

    # --- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        if self.token in _OPEN_TOKENS:
            raise ClusterError(f"a cluster with token {self.token} is up in this process: pass another token=")
        # Anything with this token is a leftover of a dead driver that had this pid.
        cleanup_leftovers(self.token)
        _OPEN_TOKENS.add(self.token)
        self._closed = False
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _build(self) -> None:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"{self.token}-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "name", self.bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", self.bridge, "up")
        # The nodes first (the first match wins), then the machine's own entries, as a cluster's hosts file
        # would have them; with `own_hostnames=False` those map the shared hostname as the machine does.
        machine_hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else "127.0.0.1 localhost\n"
        hosts = "".join(f"{n.address} {n.name}\n" for n in self.nodes.values()) + machine_hosts
        for node in self.nodes.values():
            # The folder first: `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts when it exists.
            (NETNS_ETC / node.namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / node.namespace / "hosts").write_text(hosts)
            _ip("netns", "add", node.namespace)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            # Created in the switch namespace with the peer moved straight into the node's: never on the host.
            _ip(
                "-n", self.switch, "link", "add", "name", node.switch_port, "type", "veth",
                "peer", "name", NODE_INTERFACE, "netns", node.namespace,
            )  # fmt: skip
            _ip("-n", self.switch, "link", "set", node.switch_port, "master", self.bridge)
            _ip("-n", self.switch, "link", "set", node.switch_port, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", NODE_INTERFACE)
            _ip("-n", node.namespace, "link", "set", NODE_INTERFACE, "up")
            self.node_tmp(node.name).mkdir(exist_ok=True)

    def close(self) -> None:
        """Tear everything down (idempotent; signals are held off meanwhile so a second Ctrl-C cannot cut
        the teardown short)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        in_main = threading.current_thread() is threading.main_thread()
        held = {}
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                held[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            for timer in self._timers:
                timer.cancel()
            _stop([s.proc for s in self._started], self.namespace_names(), self.kill_grace_s)
            for started in self._started:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    started.proc.wait(timeout=1)
            for node in self.nodes.values():
                _remove_namespace(node.namespace)
            _remove_namespace(self.switch)
        finally:
            if in_main:
                for sig, handler in held.items():
                    signal.signal(sig, handler)
                self._restore_signal_handlers()
            atexit.unregister(self.close)
            _OPEN_TOKENS.discard(self.token)

    def _install_signal_handlers(self) -> None:
        """SIGTERM and SIGHUP to the driver unwind like Ctrl-C does, so `__exit__` tears down."""
        if threading.current_thread() is not threading.main_thread():
            return

        def unwind(signum, frame):
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, unwind)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # e.g. started in the background by a shell
            self._previous_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    # --- processes -------------------------------------------------------------------------------

    def command(self, node: str, argv: list[str]) -> list[str]:
        """`argv` wrapped to run in `node`'s namespace under its hostname (what `popen` runs)."""
        ns = self.nodes[node].namespace
        if not self.own_hostnames:
            return [IP, "netns", "exec", ns, *argv]
        set_hostname_then_exec = 'hostname "$0" && exec "$@"'
        return [IP, "netns", "exec", ns, UNSHARE, "--uts", "--", "sh", "-c", set_hostname_then_exec, node, *argv]

    def popen(
        self, node: str, argv: list[str], *, env: dict[str, str] | None = None, label: str | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start `argv` on `node`: its own process group, stdout and stderr to `<log_dir>/<node>.<label>.log`.

        `env` is added to the driver's environment, less what a launcher set for the driver itself (RANK,
        MASTER_ADDR, GLOO_SOCKET_IFNAME, ...: `LAUNCH_VARIABLES`), which would mislead a launch on a node;
        TMPDIR is the node's own folder, `<log_dir>/<node>.tmp` (a host has a /tmp of its own; torchrun's
        temporary folders stay with the logs). The process is killed with its group at teardown.
        """
        if self._closed:
            raise ClusterError("the cluster is not up: use it inside `with Cluster(...)`")
        label = label or Path(argv[0]).name
        log_path = self.log_dir / f"{node}.{label}.{len(self._started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                self.command(node, argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**_inherited_environment(), "TMPDIR": str(self.node_tmp(node)), **(env or {})},
                start_new_session=True,
                **kwargs,
            )
        self._started.append(_Started(node, proc, log_path))
        return proc

    def run(
        self, node: str, argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run a short command on `node` and wait for it: its exit code and output (stdout and stderr
        together, in `.stdout`); killed with its group past `timeout_s`."""
        proc = self.popen(node, argv, env=env, label="run")
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop([proc], [], 1.0)
            raise ClusterError(f"{node}: {argv} still ran after {timeout_s} s\n{self.log(proc)}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, self.log(proc), "")

    def wait(self, procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
        """The exit codes of `procs`, waiting at most `timeout_s` for all of them together."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise ClusterError(f"pid {proc.pid} ({proc.args[-1]}) still ran after {timeout_s} s") from None
        return codes

    def log(self, proc: subprocess.Popen) -> str:
        """What `proc` (started by `popen`) wrote so far."""
        started = next(s for s in self._started if s.proc is proc)
        return started.log_path.read_text(errors="replace")

    # --- faults ----------------------------------------------------------------------------------

    def link_down(self, node: str, seconds: float | None = None) -> None:
        """Unplug `node`'s cable: its port on the switch goes down (the node keeps its address and routes
        and sees NO-CARRIER; what it sends is dropped, so connections stall rather than fail at once).
        With `seconds`, plugged back in after that long."""
        _ip("-n", self.switch, "link", "set", self.nodes[node].switch_port, "down")
        if seconds is not None:
            timer = threading.Timer(seconds, self._link_up_if_open, args=(node,))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def link_up(self, node: str) -> None:
        """Plug `node`'s cable back in."""
        _ip("-n", self.switch, "link", "set", self.nodes[node].switch_port, "up")

    def _link_up_if_open(self, node: str) -> None:
        if not self._closed:
            with contextlib.suppress(ClusterError):
                self.link_up(node)

    # --- lookups ---------------------------------------------------------------------------------

    def node_tmp(self, node: str) -> Path:
        """`node`'s temporary folder (its processes' TMPDIR)."""
        assert self.log_dir is not None, "the cluster is not up"
        return self.log_dir / f"{node}.tmp"

    def address(self, node: str) -> str:
        return self.nodes[node].address

    def namespace_names(self) -> list[str]:
        """Every namespace this cluster owns (for checks that none is left)."""
        return [self.switch, *(n.namespace for n in self.nodes.values())]


def probe_command(
    launch: str, rank: int, endpoint_node: str = "train-0", port: int = 29400, extra: tuple[str, ...] = ()
) -> list[str]:
    """The torchrun command of the all-reduce probe for node `rank` of two, as a user types it on a node
    (docs/guides/multi-node.md shows it); `extra` flags go before the module."""
    if launch == "c10d":
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint_node}:{port}", "--rdzv-id=probe"]
    elif launch == "static":
        rendezvous = [f"--master-addr={endpoint_node}", f"--master-port={port}", f"--node-rank={rank}"]
    else:
        raise ValueError(f"launch {launch!r}: c10d or static")
    probe = ["-m", "benchmarks.cluster.allreduce_probe"]
    return ["torchrun", "--nnodes=2", "--nproc-per-node=1", *rendezvous, *extra, *probe]


def main(argv: list[str] | None = None) -> int:
    """`probe`: two trainer nodes, the all-reduce probe launched on both, teardown; `cleanup`: leftovers."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster.netns", description=main.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    probe = sub.add_parser("probe", help="torchrun's all-reduce across two namespaces (root)")
    probe.add_argument("--launch", choices=("c10d", "static"), default="c10d")
    probe.add_argument("--log-dir", type=Path, default=None)
    probe.add_argument("--timeout-s", type=float, default=120.0)
    cleanup = sub.add_parser("cleanup", help="remove what runs whose driver died left behind")
    cleanup.add_argument("--token", default=None, help="this run's only (lgr<pid>), even if its driver lives")
    args = parser.parse_args(argv)

    reason = available()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    if args.action == "cleanup":
        removed = cleanup_leftovers(args.token)
        print("removed:", " ".join(removed) if removed else "nothing")
        return 0
    repo = Path(__file__).resolve().parents[2]
    python_dir = Path(sys.executable).parent
    env = {"PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "PATH": f"{python_dir}{os.pathsep}{os.environ['PATH']}"}
    with Cluster(("train-0", "train-1"), log_dir=args.log_dir) as cluster:
        procs = [
            cluster.popen(node, probe_command(args.launch, rank), env=env, cwd=repo, label="torchrun")
            for rank, node in enumerate(("train-0", "train-1"))
        ]
        try:
            codes = cluster.wait(procs, args.timeout_s)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: the cluster is torn down on the way out
            print("interrupted", file=sys.stderr)
            return 130
        except ClusterError as exc:
            print(exc, file=sys.stderr)
            codes = [proc.poll() for proc in procs]
        for node, proc in zip(("train-0", "train-1"), procs, strict=True):
            lines = [line for line in cluster.log(proc).splitlines() if line.startswith("allreduce ")]
            print(f"{node}: exit {proc.returncode}", *lines, sep="\n  ")
        print("logs:", cluster.log_dir)
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
