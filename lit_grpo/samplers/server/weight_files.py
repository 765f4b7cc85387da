"""A weight sync to the vLLM servers: the policy's weights as a file they reload (one safetensors
file, replaced atomically) or streamed to them, every replica paused, loaded and resumed phase by
phase (`sync_replicas`), and the sampler's side of it (`ServerWeightSync`)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional

import torch

from lit_grpo.errors import EnvironmentFault
from lit_grpo.samplers.base import strip_wrapper_prefixes
from lit_grpo.samplers.server.host import ServerSamplerState

WEIGHTS_FILE = "model.safetensors"

log = logging.getLogger(__name__)


def write_weight_file(
    named_tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, filename: str = WEIGHTS_FILE
) -> int:
    """Write the tensors (wrapper prefixes stripped) to `folder/filename`, replacing it atomically
    (a server never reads a half-written file); returns how many were written (0: nothing
    written). Tied weights are written under every name, each its own copy."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in named_tensors:
        t = tensor.detach()
        t = t.cpu() if t.device.type != "cpu" else t
        if t.untyped_storage().data_ptr() in storages or not t.is_contiguous():  # safetensors refuses shared storage
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[strip_wrapper_prefixes(name)] = t
    if not tensors:
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{filename}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / filename)
    return len(tensors)


class ServerError(EnvironmentFault, RuntimeError):
    """A vLLM server failed a request (after its retries), refused it, or is gone; the message names it."""


class WeightSyncError(EnvironmentFault, RuntimeError):
    """A weight sync failed or timed out on a server (named in the message): its weights may be stale.
    `servers`: the URLs of those servers, where the raiser knows them."""

    def __init__(self, message: str, servers: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.servers = list(servers)


async def sync_replicas(
    call: Callable[..., Any],
    live: list,
    version: int,
    folder: str,
    timeout: float,
    transfer: Optional[Callable[[list[str]], None]] = None,
    images: bool = False,
) -> None:
    """Every replica of `live` to weight `version` from `folder`, phase by phase: all paused (requests
    in flight kept) before any reloads; reload, reset the prefix cache (frozen requests recompute
    with the new weights) and, where images were sampled (`images`), the encoder cache (image
    features computed with the old weights: vLLM asks for it at every weight update), set the
    version; then every one resumed, even where the sync failed (a paused engine would hold its
    requests forever) and its version read back. `call(replica,
    method, path, timeout=, ...)` is the client's HTTP call. `WeightSyncError` names every server
    that failed; those are marked down. `transfer(urls)` (blocking, run in a thread): replaces
    the reload, streaming the weights to all the paused servers at once (`weight_transfer`);
    a `WeightSyncError` from it fails the servers it names (all of them if it names none)."""
    t = timeout

    async def reload(r: Any) -> None:
        await call(
            r,
            "POST",
            "/collective_rpc",
            timeout=t,
            json={"method": "reload_weights", "kwargs": {"weights_path": folder}, "timeout": t},
        )
        await after_load(r)

    async def after_load(r: Any) -> None:
        for _ in range(20):  # recompute the frozen requests' KV with the new weights; drop cached prefixes
            answer = await call(r, "POST", "/reset_prefix_cache", timeout=t, params={"reset_running_requests": "true"})
            if answer is None or answer.get("success", True):
                break
            await asyncio.sleep(0.05)
        else:
            raise ServerError(f"vLLM server {r.url}: /reset_prefix_cache kept failing after the reload")
        if images:
            await call(r, "POST", "/reset_encoder_cache", timeout=t)
        await call(r, "POST", "/update_weight_version", timeout=t, json={"new_version": str(version)})

    async def resume(r: Any) -> None:
        await call(r, "POST", "/resume", timeout=t)
        served = (await call(r, "GET", "/weight_info", timeout=t) or {}).get("weight_version")
        if served != str(version):
            raise ServerError(
                f"vLLM server {r.url} reports weight version {served!r} after the sync, expected {version}"
            )
        r.version = version

    failed: dict[str, str] = {}

    async def transfer_all(transfer: Callable[[list[str]], None]) -> None:  # one collective, then each one's tail
        targets = [r.url for r in live if r.url not in failed]
        if not targets:
            return
        try:  # the transfer's own calls have deadlines; this one bounds the whole
            await asyncio.wait_for(asyncio.to_thread(transfer, targets), timeout=4 * t)
        except Exception as err:  # noqa: BLE001 (named below)
            named = [u for u in getattr(err, "servers", []) if u in targets] or targets
            failed.update({u: _describe(err) for u in named})

    phases: list = [lambda r: call(r, "POST", "/pause", timeout=t, params={"mode": "keep"})]
    phases += [reload] if transfer is None else [None, after_load]
    for phase in phases:
        if phase is None:
            assert transfer is not None  # the phase exists only with a transfer
            await transfer_all(transfer)
            continue
        results = await asyncio.gather(*(phase(r) for r in live if r.url not in failed), return_exceptions=True)
        for r, result in zip([r for r in live if r.url not in failed], results):
            if isinstance(result, BaseException):
                failed[r.url] = _describe(result)
    # Resume even where the sync failed: an engine left paused would hold its requests forever.
    results = await asyncio.gather(*(resume(r) for r in live), return_exceptions=True)
    for r, result in zip(live, results):
        if isinstance(result, BaseException) and r.url not in failed:
            failed[r.url] = _describe(result)
    for r in live:
        if r.url in failed:  # its weights are unknown: it never serves this run again
            r.down = r.down or f"weight sync to version {version} failed"
            r.version = None
    if failed and len(failed) < len(live):
        log.warning(
            "weight sync %d: dropped %s; training goes on with the %d other server(s) holding version %d",
            version,
            "; ".join(f"vLLM server {url} ({why})" for url, why in failed.items()),
            len(live) - len(failed),
            version,
        )
    elif failed:
        raise WeightSyncError(
            f"weight sync to version {version} failed on "
            + "; ".join(f"{url} ({why})" for url, why in failed.items())
            + ": no server holds the new weights; "
            "training stops rather than sample from stale ones",
            servers=list(failed),
        )


def _describe(err: BaseException) -> str:
    if isinstance(err, (ServerError, WeightSyncError)):
        return str(err)
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    return f"{type(err).__name__}: {err}"


async def tag_version(call: Callable[..., Any], replicas: list[Any], version: int, timeout: float) -> None:
    """Tell every replica that it serves `version`, checked by reading it back (`WeightSyncError`
    naming one that disagrees)."""

    async def tag(r: Any) -> None:
        await call(r, "POST", "/update_weight_version", timeout=timeout, json={"new_version": str(version)})
        served = (await call(r, "GET", "/weight_info", timeout=timeout) or {}).get("weight_version")
        if served != str(version):
            raise WeightSyncError(f"vLLM server {r.url} reports weight version {served!r}, expected {version}")
        r.version = version

    await asyncio.gather(*(tag(r) for r in replicas))


async def served_versions(call: Callable[..., Any], replicas: list[Any]) -> dict[str, Optional[str]]:
    """What each replica reports serving (`/weight_info`), by URL (None: no answer)."""

    async def ask(r: Any) -> Optional[str]:
        try:
            return (await call(r, "GET", "/weight_info", timeout=10.0) or {}).get("weight_version")
        except ServerError:
            return None

    return dict(zip([r.url for r in replicas], await asyncio.gather(*(ask(r) for r in replicas))))


class ServerWeightSync(ServerSamplerState):
    """The weight sync of `VLLMServerSampler`: its `_load`, and the version its replicas serve."""

    last_sync_bytes: int = 0
    """What the last sync sent: the weights file's size, or the streamed tensors' bytes."""

    @torch.no_grad()
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every live replica to the next version, phase by phase (`sync_replicas`): reloaded from a
        safetensors file in `weight_sync_dir`, or with a transport streamed the tensors."""
        start, version = time.perf_counter(), self.version + 1
        live = [r for r in self.replicas if r.down is None]
        if not live:
            raise WeightSyncError("no vLLM server left to sync weights to: " + "; ".join(self.failovers))
        transport, transfer = self.transport, None
        if transport is None:  # written tensor by tensor: a sharded policy's are gathered one at a time
            if not write_weight_file(named_tensors, self.weight_sync_dir):
                raise WeightSyncError("the weight sync was given no tensors")
            self.last_sync_bytes = (self.weight_sync_dir / WEIGHTS_FILE).stat().st_size
        else:  # streamed while the servers are paused (`weight_transfer`)
            named = [(n, t.detach()) for n, t in named_tensors]
            if not named:
                raise WeightSyncError("the weight sync was given no tensors")
            self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in named)
            transfer = lambda urls: transport.send(urls, named)  # noqa: E731 (run on a worker thread)
        folder = str(self.weight_sync_dir.resolve())
        try:
            # Each server call has its own deadline (sync_timeout_s); this bound is only for a stuck
            # client loop: cancelling between phases could leave a server paused.
            sync = sync_replicas(
                self.router.call, live, version, folder, self.sync_timeout_s, transfer=transfer, images=self.sent_images
            )
            # With partial rollouts the streams in flight are closed first, and continue after it.
            held = self._streams.hold(sync, version, interrupt=True) if self.partial_rollouts else sync
            self._run(held, timeout=8 * self.sync_timeout_s)
        except TimeoutError:
            raise WeightSyncError(
                f"weight sync to version {version} did not finish within "
                f"{8 * self.sync_timeout_s:g} s: the servers may hold stale weights"
            ) from None
        self.version = version
        served = sum(r.down is None for r in self.replicas)
        log.debug("weight sync %d: %d server(s) in %.3f s", version, served, time.perf_counter() - start)

    def set_version(self, version: int) -> None:
        """Tell every live replica that it serves `version` (the servers this sampler started from
        the policy's own weights), checked by reading it back."""
        live = [r for r in self.replicas if r.down is None]
        self._run(
            tag_version(self.router.call, live, version, self.request_timeout_s), timeout=self.request_timeout_s + 5.0
        )
        self.version = version

    def served_versions(self) -> dict[str, Optional[str]]:
        """What each replica reports serving now (`/weight_info`), by URL (None: no answer)."""
        return self._run(served_versions(self.router.call, self.replicas), timeout=15.0)
