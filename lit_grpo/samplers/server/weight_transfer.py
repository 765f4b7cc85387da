"""Weight syncs through vLLM's weight-transfer API (`sampler.weight_transfer: gloo | nccl`).

The default transport (`reload`, `server_weights.sync_replicas`) writes safetensors that every
server reloads. These stream the tensors instead, with vLLM's own trainer-side classes:
`WeightTransferTrainerFactory.trainer_init` builds the backend's trainer engine, which drives the
servers' `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update` through a client (`FanOutClient`: vLLM's `HTTPVLLMWeightSyncClient`, one
per server, called on all of them at once, every call with a deadline, every failure a
`WeightSyncError` naming the server).

- `gloo` (backend `lit_grpo_gloo`, `lit_grpo.samplers.server.vllm_plugin.gloo`): CPU, torch.distributed gloo.
- `nccl` (vLLM's built-in dense NCCL backend): GPU servers and a GPU trainer; the same code path
  with another backend name, untested here (no GPU).

One transfer group spans this process (rank 0, which hosts the rendezvous on a free port of
`address`) and every worker of every server: server i's workers start at rank
`1 + (workers of servers 0..i-1)` (each server's worker count from its `/get_world_size`). The
group is made at the first sync and again whenever the set of live servers changes or a sync
failed. The servers must run with `--weight-transfer-config '{"backend": ...}'` (`python -m
lit_grpo.samplers.server.serve --weight-transfer gloo|nccl`); pausing, the prefix cache, the version and
resuming stay with `sync_replicas`.
Imports vLLM (trainer side) only when a transport is built.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional
from urllib.parse import urlparse

import torch

from lit_grpo.samplers.base import strip_wrapper_prefixes
from lit_grpo.samplers.server.serve import WEIGHT_TRANSFER_BACKENDS
from lit_grpo.samplers.server.weight_files import WeightSyncError

log = logging.getLogger(__name__)

TRANSPORTS = ("reload", *WEIGHT_TRANSFER_BACKENDS)
"""`sampler.weight_transfer` values: `reload` (safetensors, the default) or a vLLM weight-transfer backend."""
BACKENDS = WEIGHT_TRANSFER_BACKENDS
"""The vLLM backend name of each streaming transport."""


def address_towards(url: str) -> str:
    """This machine's address on the route to the server at `url` (the servers connect to it)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((host, urlparse(url).port or 80))
        return s.getsockname()[0]


class FanOutClient:
    """vLLM's `VLLMWeightSyncClient` protocol over several servers: each call goes to all of them
    at once (vLLM's `HTTPVLLMWeightSyncClient` each, `timeout_s` per request) and returns when all
    answered; `WeightSyncError` (with `.servers`) names every server that failed. At init each
    server's `rank_offset` is shifted past the workers of the servers before it."""

    def __init__(self, urls: list[str], workers: list[int], timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.urls = urls
        self.clients = [HTTPVLLMWeightSyncClient(u, timeout=timeout_s) for u in urls]
        self.shifts = [sum(workers[:i]) for i in range(len(urls))]

    def _each(self, what: str, call: Callable[[int, Any], None]) -> None:
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            futures = [pool.submit(call, i, c) for i, c in enumerate(self.clients)]
            failed = {}
            for url, future in zip(self.urls, futures):
                try:
                    future.result()
                except Exception as err:  # noqa: BLE001 (named in the error)
                    failed[url] = _describe(err)
        if failed:
            raise WeightSyncError(
                f"weight transfer: {what} failed on " + "; ".join(f"{u} ({why})" for u, why in failed.items()),
                servers=list(failed),
            )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each(
            "/init_weight_transfer_engine (a server must run `lit_grpo.samplers.server.serve --weight-transfer` "
            "with this transport)",
            lambda i, c: c.init_weight_transfer_engine(
                {**init_info, "rank_offset": init_info["rank_offset"] + self.shifts[i]}
            ),
        )

    def start_weight_update(self) -> None:
        self._each("/start_weight_update", lambda i, c: c.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        self._each("/update_weights", lambda i, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._each("/finish_weight_update", lambda i, c: c.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._each("/shutdown_weight_transfer_engine", lambda i, c: c.shutdown_weight_transfer_engine())


def _describe(err: BaseException) -> str:
    response = getattr(err, "response", None)
    if response is not None:
        return f"HTTP {response.status_code}: {response.text[:300]}"
    return f"{type(err).__name__}: {err}"


def _named_source(device: torch.device):
    """A vLLM `WeightSource` over the tensors of the current sync (names without wrapper prefixes)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class NamedTensors(WeightSource):
        def __init__(self) -> None:
            self.tensors: list[tuple[str, torch.Tensor]] = []

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.tensors:
                yield name, tensor.to(device).contiguous()

    return NamedTensors()


class WeightTransport:
    """One sampler's transfer group and trainer engine (see the module docstring). `send` is
    blocking (call it off the event loop); `close` tears the group down."""

    def __init__(
        self, transport: str, *, timeout_s: float, address: Optional[str] = None, buffer_size_bytes: int = 64 << 20
    ) -> None:
        if transport not in BACKENDS:
            raise ValueError(f"weight_transfer must be one of {TRANSPORTS}, got {transport!r}")
        self.transport, self.timeout_s, self.address = transport, timeout_s, address
        self.buffer_size_bytes = buffer_size_bytes
        self.engine: Any = None
        self.client: Optional[FanOutClient] = None
        self.urls: list[str] = []
        self._source: Any = None

    def send(self, urls: list[str], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the tensors to every worker of the servers at `urls` (start, update, finish).
        `WeightSyncError` naming the servers (`.servers`) on any failure; the group is then
        discarded and made anew at the next sync."""
        tensors = [(strip_wrapper_prefixes(n), t.detach()) for n, t in named_tensors]
        if not tensors:
            raise WeightSyncError("the weight sync was given no tensors")
        try:
            if self.engine is None or urls != self.urls:
                self._start(urls)
            self._source.tensors = tensors
            self.engine.send_weights()
        except BaseException as err:
            self._drop()
            if isinstance(err, WeightSyncError):
                raise
            raise WeightSyncError(
                f"weight transfer ({self.transport}) to {', '.join(urls)} failed: {_describe(err)}", servers=list(urls)
            ) from err
        finally:
            if self._source is not None:
                self._source.tensors = []

    def _start(self, urls: list[str]) -> None:
        """A new group: rendezvous of this process and every worker of `urls`."""
        import requests

        from lit_grpo.samplers.server.pool import free_port
        from lit_grpo.samplers.server.serve import patch_vllm_version

        patch_vllm_version()  # the CPU build: vLLM's platform detection reads it
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from lit_grpo.samplers.server.vllm_plugin import register

        register()
        self._drop()
        workers = []
        for url in urls:
            try:
                answer = requests.get(f"{url}/get_world_size", timeout=self.timeout_s)
                answer.raise_for_status()
                workers.append(int(answer.json()["world_size"]))
            except Exception as err:  # noqa: BLE001
                raise WeightSyncError(
                    f"vLLM server {url}: /get_world_size failed ({_describe(err)})", servers=[url]
                ) from None
        address = self.address or address_towards(urls[0])
        port = free_port(address)
        rendezvous: dict[str, Any] = dict(master_address=address, master_port=port, world_size=1 + sum(workers), rank=0)
        if self.transport == "gloo":
            from lit_grpo.samplers.server.vllm_plugin.gloo import GlooTrainerInitInfo

            info: Any = GlooTrainerInitInfo(
                **rendezvous, timeout_s=self.timeout_s, buffer_size_bytes=self.buffer_size_bytes
            )
            device = torch.device("cpu")
        else:  # untested here: needs CUDA on the trainer and the servers
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(**rendezvous)
            device = torch.device("cuda", torch.cuda.current_device())
        self.client = FanOutClient(urls, workers, self.timeout_s)
        self._source = _named_source(device)
        log.info("weight transfer (%s): group of %d ranks at %s:%d", self.transport, 1 + sum(workers), address, port)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self._source)
        self.urls = list(urls)

    def _drop(self) -> None:
        """Forget the group (the servers' side is replaced at the next init)."""
        engine, self.engine, self.urls = self.engine, None, []
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 (a broken group)
                log.debug("shutting the weight transfer group down failed", exc_info=True)

    def close(self) -> None:
        """Tear the group down on both sides (best effort: the servers may be gone already)."""
        client, had = self.client, self.engine is not None
        self._drop()
        if had and client is not None:
            try:
                client.shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001
                log.debug("/shutdown_weight_transfer_engine failed", exc_info=True)
