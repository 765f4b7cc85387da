"""Adapter-only weight syncs of a LoRA policy (`sampler.lora_sync=adapter`).

At each sync only the adapter's weights are written (peft's `adapter_model.safetensors` and
`adapter_config.json`, in `weight_sync_dir/<name>`), every live server loads them as a new adapter
(`/v1/load_lora_adapter`), and from then on the client names that adapter in its requests. The base
weights never move. Nothing is paused: a request already running keeps the adapter it named, so a
rollout that began before the sync finishes on its own weights, and its tokens keep their version
exactly.

An adapter's name is `policy-<run tag>-v<version>`: the tag is drawn when the sampler starts, so two
runs on the same servers, or a run and its resume after a preemption, never ask for a name the
other loaded (a server refuses to load a name twice), and the version is the run's policy version,
which a resumed run continues from its checkpoint. Each sampler unloads the adapters it loaded: the
oldest once more than `max_loras` are loaded, the rest when it closes. A killed run cannot unload
its own; the servers keep serving under the others' names, and vLLM's adapter cache evicts the
unused ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lit_grpo.samplers.server.host import ServerSamplerState
from lit_grpo.samplers.server.weight_files import ServerError, WeightSyncError, write_weight_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"
RELEASE_TIMEOUT_S = 5.0
"""How long closing a sampler waits for the servers to unload its adapters (they are only tidied)."""

log = logging.getLogger(__name__)


def new_adapter_prefix() -> str:
    """The prefix of one run's adapter names: `policy-` and 8 random hex digits."""
    return f"policy-{secrets.token_hex(4)}"


def adapter_name(prefix: str, version: int) -> str:
    """The name a server serves the adapter of policy `version` under."""
    return f"{prefix}-v{version}"


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


def why_load_failed(err: BaseException) -> str:
    """What a failed `/v1/load_lora_adapter` says of the server: the route is missing (404) when the
    server was started without runtime LoRA; otherwise the server's own answer stands alone."""
    text = str(err)
    if "/v1/load_lora_adapter answered 404" in text:
        return ": the server does not load adapters at run time (start it with lit_grpo.serve --lora-rank R)"
    if "answered 5" in text and "lora" in text.lower() and "not enabled" in text.lower():
        return ": the server was started without LoRA (start it with lit_grpo.serve --lora-rank R)"
    return ""


async def unload_adapters(call: Callable[..., Any], live: list, names: list[str], timeout: float) -> None:
    """Every replica of `live` unloads the adapters `names`; one it does not hold (a server restarted
    since) or a replica that fails is only noted: an adapter left loaded costs a slot, not a result."""

    async def one(r: Any, name: str) -> None:
        try:
            await call(r, "POST", "/v1/unload_lora_adapter", timeout=timeout, json={"lora_name": name})
        except ServerError as err:
            log.debug("unloading adapter %s from %s: %s", name, r.url, err)

    await asyncio.gather(*(one(r, name) for r in live for name in names))


async def load_adapter(
    call: Callable[..., Any], live: list, version: int, name: str, folder: str, timeout: float, *, replace: bool
) -> None:
    """Every replica of `live` loads the adapter in `folder` as `name` and names it in its requests from
    then on, reporting `version` (`replace`: this sampler loaded `name` before, unload it first). A
    replica that fails is marked down; `WeightSyncError` when all fail."""

    async def one(r: Any) -> None:
        if replace:
            await unload_adapters(call, [r], [name], timeout)
        await call(r, "POST", "/v1/load_lora_adapter", timeout=timeout, json={"lora_name": name, "lora_path": folder})
        r.model = name
        await call(r, "POST", "/update_weight_version", timeout=timeout, json={"new_version": str(version)})
        r.version = version

    results = await asyncio.gather(*(one(r) for r in live), return_exceptions=True)
    failed = {r.url: result for r, result in zip(live, results) if isinstance(result, BaseException)}
    for r in live:
        if r.url in failed:
            r.down = r.down or f"adapter sync to version {version} failed"
            r.version = None
    if failed and len(failed) == len(live):
        raise WeightSyncError(
            f"adapter sync to version {version} ({name}) failed on "
            + "; ".join(f"{url} ({err}){why_load_failed(err)}" for url, err in failed.items()),
            servers=list(failed),
        )
    if failed:
        log.warning(
            "adapter sync %d: dropped %s; training goes on with the other server(s)",
            version,
            "; ".join(f"vLLM server {url} ({err})" for url, err in failed.items()),
        )


class AdapterSync(ServerSamplerState):
    """The adapter-only weight sync of `VLLMServerSampler` (`enable_adapter_sync`, `update_adapter`,
    `release_adapters`)."""

    max_loras: int = 0
    """Adapters each server keeps loaded (0: adapter sync is off, every sync sends merged weights)."""
    adapter_prefix: str = ""
    """This run's adapter names begin with it (`policy-<run tag>`; see the module docstring)."""

    def enable_adapter_sync(self, max_loras: int) -> None:
        """Sync a LoRA policy by its adapter alone (`update_adapter`); the servers keep `max_loras` loaded."""
        self.max_loras = max_loras
        self.adapter_prefix = new_adapter_prefix()
        self.loaded_adapters: list[str] = []
        """The adapters this sampler loaded and has not unloaded, oldest first."""

    @torch.no_grad()
    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any, version=None) -> None:
        """Load the policy's adapter (peft-named tensors and `LoraConfig`) on every live server as
        version `version` (default: the next one) and serve it from now on. Requests that start
        meanwhile wait (partial rollouts), so every token's version is the adapter it ran on."""
        version = self.version + 1 if version is None else int(version)
        live = [r for r in self.replicas if r.down is None]
        if not live:
            raise WeightSyncError("no vLLM server left to sync the adapter to: " + "; ".join(self.failovers))
        name = adapter_name(self.adapter_prefix, version)
        folder = self.weight_sync_dir / name
        self.last_sync_bytes = write_adapter(named_tensors, config, folder)
        replace = name in self.loaded_adapters  # a resume at the version the sampler started at
        load = load_adapter(
            self.router.call, live, version, name, str(folder.resolve()), self.sync_timeout_s, replace=replace
        )
        try:
            self._run(self._streams.hold(load, version, interrupt=False), timeout=4 * self.sync_timeout_s)
        except TimeoutError:
            raise WeightSyncError(
                f"adapter sync to version {version} did not finish within {4 * self.sync_timeout_s:g} s"
            ) from None
        self.version = version
        if not replace:
            self.loaded_adapters.append(name)
        old, self.loaded_adapters = self.loaded_adapters[: -self.max_loras], self.loaded_adapters[-self.max_loras :]
        if old:
            live = [r for r in self.replicas if r.down is None]
            unload = unload_adapters(self.router.call, live, old, self.sync_timeout_s)
            self._run(unload, timeout=self.sync_timeout_s + 5.0)
            for gone in old:
                shutil.rmtree(self.weight_sync_dir / gone, ignore_errors=True)

    def release_adapters(self) -> None:
        """Unload every adapter this sampler loaded from the servers it shares with other runs
        (bounded by `RELEASE_TIMEOUT_S`; what is left is only an unused slot)."""
        names, self.loaded_adapters = list(getattr(self, "loaded_adapters", [])), []
        live = [r for r in self.replicas if r.down is None]
        if not names or not live:
            return
        try:
            self._run(unload_adapters(self.router.call, live, names, RELEASE_TIMEOUT_S), timeout=RELEASE_TIMEOUT_S + 1)
        except Exception as err:  # tidying only: a run that trained must not fail here
            log.debug("unloading this run's adapters: %s", err)
