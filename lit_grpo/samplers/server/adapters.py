"""Adapter-only weight syncs of a LoRA policy (`sampler.lora_sync=adapter`).

At each sync only the adapter's weights are written (peft's `adapter_model.safetensors` and
`adapter_config.json`, in `weight_sync_dir/adapter-v<version>`), every live server loads them as
a new adapter, `policy-v<version>` (`/v1/load_lora_adapter`), and from then on the client names
that adapter in its requests. The base weights never move. Nothing is paused: a request already
running keeps the adapter it named, so a rollout that began before the sync finishes on its own
weights, and its tokens keep their version exactly. The servers keep `max_loras` adapters loaded;
the one `max_loras` versions older than the new one is unloaded, and its folder removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lit_grpo.samplers.server.weight_files import ServerError, WeightSyncError, write_weight_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"

log = logging.getLogger(__name__)


def adapter_name(version: int) -> str:
    """The name a server serves the adapter of policy `version` under."""
    return f"policy-v{version}"


def adapter_folder(root: Path, version: int) -> Path:
    return root / f"adapter-v{version}"


def write_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any, folder: Path) -> int:
    """The adapter as peft saves it, in `folder` (written beside it, then renamed into place, so a
    server never reads half an adapter); returns the bytes of its weights file. `config`: the
    adapter's peft `LoraConfig`."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if not write_weight_file(named_tensors, tmp, ADAPTER_WEIGHTS):
        raise WeightSyncError("the adapter sync was given no adapter tensors (is the policy a LoRA model?)")
    config.save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return (folder / ADAPTER_WEIGHTS).stat().st_size


async def load_adapter(
    call: Callable[..., Any], live: list, version: int, folder: str, max_loras: int, timeout: float
) -> None:
    """Every replica of `live` loads the adapter in `folder` as `adapter_name(version)` and names it
    in its requests from then on, reporting `version`; the adapter `max_loras` versions older is
    unloaded. A replica that fails is marked down; `WeightSyncError` when all fail."""
    name, old = adapter_name(version), adapter_name(version - max_loras)

    async def one(r: Any) -> None:
        await call(r, "POST", "/v1/load_lora_adapter", timeout=timeout, json={"lora_name": name, "lora_path": folder})
        r.model = name
        await call(r, "POST", "/update_weight_version", timeout=timeout, json={"new_version": str(version)})
        r.version = version
        if version - max_loras >= 0:
            try:  # a server restarted since, or a first version loaded elsewhere, may not hold it
                await call(r, "POST", "/v1/unload_lora_adapter", timeout=timeout, json={"lora_name": old})
            except ServerError as err:
                log.debug("unloading adapter %s from %s: %s", old, r.url, err)

    results = await asyncio.gather(*(one(r) for r in live), return_exceptions=True)
    failed = {r.url: result for r, result in zip(live, results) if isinstance(result, BaseException)}
    for r in live:
        if r.url in failed:
            r.down = r.down or f"adapter sync to version {version} failed"
            r.version = None
    if failed and len(failed) == len(live):
        raise WeightSyncError(
            f"adapter sync to version {version} failed on "
            + "; ".join(f"{url} ({err})" for url, err in failed.items())
            + ": were the servers started with LoRA on (lit_grpo.serve --lora-rank R)?",
            servers=list(failed),
        )
    if failed:
        log.warning(
            "adapter sync %d: dropped %s; training goes on with the other server(s)",
            version,
            "; ".join(f"vLLM server {url} ({err})" for url, err in failed.items()),
        )


class AdapterSync:
    """The adapter-only weight sync of `VLLMServerSampler` (`enable_adapter_sync`, `update_adapter`)."""

    max_loras: int = 0
    """Adapters each server keeps loaded (0: adapter sync is off, every sync sends merged weights)."""

    def enable_adapter_sync(self, max_loras: int) -> None:
        """Sync a LoRA policy by its adapter alone (`update_adapter`); the servers keep `max_loras` loaded."""
        self.max_loras = max_loras

    @torch.no_grad()
    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any, version=None) -> None:
        """Load the policy's adapter (peft-named tensors and `LoraConfig`) on every live server as
        version `version` (default: the next one) and serve it from now on. Requests that start
        meanwhile wait (partial rollouts), so every token's version is the adapter it ran on."""
        version = self.version + 1 if version is None else version
        live = [r for r in self.replicas if r.down is None]
        if not live:
            raise WeightSyncError("no vLLM server left to sync the adapter to: " + "; ".join(self.failovers))
        folder = adapter_folder(self.weight_sync_dir, version)
        self.last_sync_bytes = write_adapter(named_tensors, config, folder)
        load = load_adapter(self.router.call, live, version, str(folder.resolve()), self.max_loras, self.sync_timeout_s)
        try:
            self._run(self._streams.hold(load, version, interrupt=False), timeout=4 * self.sync_timeout_s)
        except TimeoutError:
            raise WeightSyncError(
                f"adapter sync to version {version} did not finish within {4 * self.sync_timeout_s:g} s"
            ) from None
        self.version = version
        shutil.rmtree(adapter_folder(self.weight_sync_dir, version - self.max_loras), ignore_errors=True)
