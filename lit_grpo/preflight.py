"""Before anything loads: can the model and the dataset the config names be reached?

On a machine without the Hugging Face hub, transformers and datasets retry for a minute and end
in a deep traceback. This check answers in seconds, naming everything unreachable and how to
point at local copies, in one `ConfigError`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lit_grpo.config import ConfigError, TrainConfig

PROBE_TIMEOUT_S = 5.0


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def _cached(repo_id: str, repo_type: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    marker = "config.json" if repo_type == "model" else "README.md"
    return isinstance(try_to_load_from_cache(repo_id, marker, repo_type=repo_type), str)


def hub_problem(repo_id: str, repo_type: str) -> Optional[str]:
    """None when `repo_id` is a local folder, in the local cache or answers on the hub; else why not."""
    if Path(repo_id).exists() or _cached(repo_id, repo_type):
        return None
    if _offline():
        return "not in the local cache, and the hub is switched off (HF_HUB_OFFLINE)"
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        (api.model_info if repo_type == "model" else api.dataset_info)(repo_id, timeout=PROBE_TIMEOUT_S)
    except Exception as err:  # no network, DNS, 404, gated: all mean "cannot load it from here"
        return f"cannot reach it on the Hugging Face hub ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
    return None


def check_sources(c: TrainConfig) -> None:
    """Raise one `ConfigError` listing every unreachable model or dataset (with the overrides that
    point at local copies) and a sampler backend that is not installed."""
    from lit_grpo.samplers import get_sampler
    from lit_grpo.tasks import source_problems

    problems = []
    if c.model.kind == "hf" and (why := hub_problem(c.model.name_or_path, "model")):
        problems.append(f"model {c.model.name_or_path!r}: {why}; use a local copy with model.name_or_path=/path/to/model")
    problems.extend(source_problems(c))
    if why := get_sampler(c.sampler.kind).missing():
        problems.append(f"sampler={c.sampler.kind}: {why}")
    if problems:
        raise ConfigError("cannot start this run:" + "".join(f"\n  - {p}" for p in problems))
