"""Local vLLM servers as subprocesses (`python -m lit_grpo.serve`), each in its own process group.

`start_servers` launches them, `ServerPool.wait_ready` waits for `/health` with a deadline, and
`ServerPool.stop` ends them: SIGTERM to each process group, SIGKILL after a grace period. The
servers also stop themselves when the process that started them is gone (`--exit-with-parent`),
and an `atexit` hook stops any still running when this interpreter exits. Used by the
`vllm_server` sampler when it starts its own servers, and by the tests. Imports no vLLM.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lit_grpo.samplers.server.keys import KEY_ENV

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long a server gets to exit after SIGTERM before its process group is killed."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url/health` answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except Exception:
        return False


@dataclass
class ServerProcess:
    """One local server."""

    url: str
    process: subprocess.Popen
    log_path: Path
    cpu_core: Optional[int] = None

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's output (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s` if it is still there."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("vLLM server %s did not exit %g s after SIGTERM; killing it", self.url, grace_s)
        # The engine process may outlive the server process: the group goes either way.
        _signal_group(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.error("vLLM server %s (pid %d) survived SIGKILL", self.url, self.process.pid)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(eq=False)
class ServerPool:
    """Servers started by `start_servers`; a context manager that stops them on exit."""

    servers: list[ServerProcess] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def wait_ready(self, timeout_s: float) -> None:
        """Return once every server answers `/health`; a RuntimeError naming the server (with its
        log's last lines) when one exits first or the deadline passes. Servers are not stopped here."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.servers)
        while waiting:
            for server in list(waiting):
                if server.process.poll() is not None:
                    raise RuntimeError(
                        f"vLLM server {server.url} exited with status {server.process.returncode} before it "
                        f"was ready; its log ({server.log_path}) ends with:\n{server.log_tail()}"
                    )
                if healthy(server.url):
                    waiting.remove(server)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(s.url for s in waiting)
                raise RuntimeError(
                    f"vLLM server(s) {names} not ready within {timeout_s:g} s; the log of "
                    f"{waiting[0].url} ({waiting[0].log_path}) ends with:\n{waiting[0].log_tail()}"
                )
            if waiting:
                time.sleep(0.5)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every server (SIGTERM to all first, so they shut down together, then SIGKILL)."""
        for server in self.servers:
            if server.process.poll() is None:
                _signal_group(server.process.pid, signal.SIGTERM)
        for server in self.servers:
            server.stop(grace_s)
        _POOLS.discard(self)

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_POOLS: weakref.WeakSet[ServerPool] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for pool in list(_POOLS):
        pool.stop(grace_s=5.0)


def default_cpu_cores(n: int) -> list[Optional[int]]:
    """One core per server, round-robin over this process's cores (None on CUDA: no pinning)."""
    try:
        import torch

        if torch.cuda.is_available():
            return [None] * n
    except ImportError:
        pass
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i % len(cores)] for i in range(n)]


def start_servers(
    model_dir: str | os.PathLike,
    n: int,
    *,
    log_dir: str | os.PathLike,
    host: str = "127.0.0.1",
    ports: Optional[Sequence[int]] = None,
    cpu_cores: Optional[Sequence[Optional[int]]] = None,
    dtype: str = "auto",
    max_model_len: Optional[int] = None,
    kv_cache_memory_bytes: Optional[str | int] = None,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    env: Optional[dict[str, str]] = None,
    ready_timeout_s: Optional[float] = 600.0,
    weight_transfer: str = "reload",
    lora_rank: int = 0,
    max_loras: int = 4,
    api_key: Optional[str] = None,
) -> ServerPool:
    """Start `n` servers of `model_dir` on free ports (or `ports`), each in its own process group,
    logging to `log_dir/server_<i>.log`; wait for them unless `ready_timeout_s` is None. On CUDA
    with at least `n` GPUs server i gets GPU i; on CPU server i is pinned to `cpu_cores[i]`
    (default: round-robin over this process's cores). `weight_transfer`: `lit_grpo.samplers.server.serve
    --weight-transfer` (reload, gloo or nccl). `lora_rank` > 0: adapters of up to that rank
    are loaded at run time, `max_loras` at once. `api_key`: the key every request but
    `/health` must carry, handed over in the servers' environment (never on their command line).
    If any fails to start, all are stopped and the error (naming it) is raised."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(n)]
    cores = list(cpu_cores) if cpu_cores is not None else default_cpu_cores(n)
    gpus = _gpu_count()
    pool = ServerPool()
    _POOLS.add(pool)
    try:
        for i in range(n):
            cmd = [
                sys.executable,
                "-m",
                "lit_grpo.serve",
                "--model",
                str(model_dir),
                "--host",
                host,
                "--port",
                str(ports[i]),
                "--dtype",
                dtype,
                "--seed",
                str(seed + i),
                "--exit-with-parent",
                str(os.getpid()),
            ]
            if cores[i] is not None:
                cmd += ["--cpu-core", str(cores[i])]
            if kv_cache_memory_bytes is not None:
                cmd += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
            if max_model_len is not None:
                cmd += ["--max-model-len", str(max_model_len)]
            if weight_transfer != "reload":
                cmd += ["--weight-transfer", weight_transfer]
            if lora_rank > 0:
                cmd += ["--lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
            cmd += list(extra_args)
            child_env = {**os.environ, **(env or {})}
            if api_key:
                child_env[KEY_ENV] = api_key
            if gpus >= n > 1:
                child_env["CUDA_VISIBLE_DEVICES"] = str(i)
            log_path = log_dir / f"server_{i}.log"
            with open(log_path, "wb") as out:
                process = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                    start_new_session=True,
                )
            pool.servers.append(ServerProcess(f"http://{host}:{ports[i]}", process, log_path, cores[i]))
            log.info("started vLLM server %s (pid %d, log %s)", pool.servers[-1].url, process.pid, log_path)
        if ready_timeout_s is not None:
            pool.wait_ready(ready_timeout_s)
    except BaseException:
        pool.stop()
        raise
    return pool


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0
