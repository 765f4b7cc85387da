"""`sampler.kind=vllm_server`'s builder: a `VLLMServerSampler` attached to running servers, or to
servers started here, serving the policy's starting weights from the first request.

Attached to `cfg.server_urls`, the servers' weights are replaced by the policy's at once (version
1); started here, they load the policy's weights from a folder written under the run's work folder
(version 0; stopped when the sampler closes). A LoRA policy with adapter sync
(`cfg.lora_sync_mode=adapter`): the servers hold the base weights, unmerged, and serve its adapter.
The weights come as `lit_grpo.build` hands them over (`lit_grpo.samplers.StartingWeights`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lit_grpo.config import ConfigError, SamplerConfig
from lit_grpo.samplers import StartingWeights
from lit_grpo.samplers.server.pool import start_servers
from lit_grpo.samplers.server.sampler import VLLMServerSampler


def build_server_sampler(
    cfg: SamplerConfig, weights: StartingWeights, tokenizer, *, work_dir: str, seed: int
) -> VLLMServerSampler:
    """The sampler of `cfg`, serving `weights` (see the module docstring)."""
    run = Path(work_dir)
    api_key = os.environ.get(cfg.api_key_env) or None  # read here, never written anywhere
    if api_key and cfg.weight_transfer != "reload":
        raise ConfigError(
            f"config field `sampler.weight_transfer`: {cfg.weight_transfer} goes through vLLM's weight-transfer "
            f"client, which sends no key, and ${cfg.api_key_env} holds one: keyed servers take weight_transfer=reload"
        )
    if cfg.weight_transfer == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("sampler.weight_transfer=nccl needs CUDA in the trainer and the servers; on CPU use gloo")
    options: dict[str, Any] = dict(
        weight_sync_dir=Path(cfg.weight_sync_dir).expanduser() if cfg.weight_sync_dir else run / "weight_sync",
        max_in_flight_per_server=cfg.max_in_flight_per_server,
        request_timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        sync_timeout_s=cfg.request_timeout_s,
        max_batch_size=cfg.max_batch_size,
        weight_transfer=cfg.weight_transfer,
        api_key=api_key,
    )
    adapter = weights.lora_rank > 0 and cfg.lora_sync_mode == "adapter"
    if not cfg.servers_to_start:
        return _attached(VLLMServerSampler(tokenizer, list(cfg.server_urls), **options), weights, adapter, cfg)
    pool = start_servers(
        _server_source(weights, adapter, run / "sampler_init"),
        cfg.servers_to_start,
        log_dir=run / "servers",
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        kv_cache_memory_bytes=cfg.server_kv_cache_memory_bytes,
        seed=seed,
        extra_args=[*_engine_args(cfg), *cfg.server_args],
        ready_timeout_s=cfg.server_startup_timeout_s,
        weight_transfer=cfg.weight_transfer,
        lora_rank=weights.lora_rank if adapter else 0,
        max_loras=cfg.max_loras,
        api_key=api_key,
    )
    try:
        sampler = VLLMServerSampler(tokenizer, pool.urls, pool=pool, **options)
    except BaseException:
        pool.stop()
        raise
    try:
        sampler.set_version(0)
        if adapter:
            _serve_the_adapter(sampler, weights, cfg)
    except BaseException:
        sampler.close()
        raise
    return sampler


def _attached(sampler: VLLMServerSampler, weights: StartingWeights, adapter: bool, cfg) -> VLLMServerSampler:
    """Running servers, made to serve the policy now, whatever they served before."""
    try:
        if adapter:  # the base weights, then the adapter on them
            sampler.update_weights(weights.base_tensors())
            _serve_the_adapter(sampler, weights, cfg)
        else:  # a LoRA policy's merged weights
            sampler.update_weights(weights.full_tensors())
    except BaseException:
        sampler.close()
        raise
    return sampler


def _serve_the_adapter(sampler: VLLMServerSampler, weights: StartingWeights, cfg) -> None:
    sampler.enable_adapter_sync(cfg.max_loras)
    tensors, config = weights.adapter()
    sampler.update_adapter(tensors, config, 0)


def _server_source(weights: StartingWeights, adapter: bool, out_dir: Path) -> Path:
    """The folder new servers load: the model's own when it was loaded from one, else one written now."""
    if weights.loaded_from is not None and Path(weights.loaded_from).expanduser().is_dir():
        return Path(weights.loaded_from).expanduser()
    if weights.lora_rank > 0:  # the servers load the base model's names: its own weights, or the adapters merged in
        return weights.write_folder(out_dir, weights.base_tensors() if adapter else weights.full_tensors())
    return weights.write_folder(out_dir, None)  # a model built here, or a hub name


def _engine_args(cfg) -> list[str]:
    extra = ["--enforce-eager"] if cfg.enforce_eager else []
    if torch.cuda.is_available():
        extra += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    return extra
