"""What a run ran on: the versions of Python and the libraries that decide its numbers, lit_grpo's
own version and git commit, and the resolved config.

    <output_dir>/provenance.json    written by rank 0 when the run starts (a crashed run has it too):
                                    {"versions": {...}, "config": {...}, "started": ..., "resumed_from": ...}
    checkpoint manifest.json        `versions` too (`RunCheckpointer`), so a resume can compare

A resume whose versions differ from its checkpoint's logs one WARNING naming each difference
(`warn_if_versions_differ`): the run goes on, but its numbers may not match an uninterrupted one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import lit_grpo
from lit_grpo.config import TrainConfig
from lit_grpo.run.checkpoint import config_as_dict, read_manifest
from lit_grpo.samplers.vllm_boundary import installed_vllm_version

log = logging.getLogger(__name__)
PROVENANCE_FILE = "provenance.json"
LIBRARIES = ("torch", "transformers", "lightning")
"""Distributions whose versions every run records (vLLM too, when the sampler uses it)."""
GIT_TIMEOUT_S = 5.0


@functools.cache
def git_commit() -> Optional[str]:
    """`git rev-parse HEAD` of the checkout lit_grpo is imported from (None: an installed copy, no
    git, or no answer within GIT_TIMEOUT_S)."""
    root = Path(lit_grpo.__file__).resolve().parent.parent
    if not (root / ".git").exists():  # a folder, or a worktree's file
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_versions(sampler_kind: str) -> dict[str, Optional[str]]:
    """Python, torch, transformers, Lightning, vLLM (sampler=vllm or vllm_server), lit_grpo and its commit."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    versions.update({name: _version(name) for name in LIBRARIES})
    if sampler_kind in ("vllm", "vllm_server"):
        versions["vllm"] = installed_vllm_version()
    versions["lit_grpo"] = lit_grpo.__version__
    versions["lit_grpo_commit"] = git_commit()
    return versions


def write_provenance(c: TrainConfig, resumed_from: Optional[Path] = None) -> dict:
    """Write `<output_dir>/provenance.json` (versions, resolved config, start time, command) and return it."""
    record = {
        "versions": run_versions(c.sampler.kind),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": sys.argv,
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
        "config": config_as_dict(c),
    }
    (Path(c.output_dir) / PROVENANCE_FILE).write_text(json.dumps(record, indent=1, default=str))
    return record


def version_changes(saved: dict, now: dict) -> list[str]:
    """`name saved -> now` for each version that differs (one the checkpoint did not record is skipped)."""
    return [f"{name} {saved[name]} -> {now.get(name)}" for name in saved if name in now and saved[name] != now[name]]


def warn_if_versions_differ(checkpoint: Path, versions: dict) -> list[str]:
    """One WARNING when `checkpoint`'s recorded versions differ from `versions` (returns the changes)."""
    manifest, _ = read_manifest(checkpoint)
    saved = manifest.get("versions") if manifest else None
    if not isinstance(saved, dict):
        log.info(
            "checkpoint %s records no versions (written by an older lit_grpo): they cannot be compared", checkpoint
        )
        return []
    changes = version_changes(saved, versions)
    if changes:
        log.warning(
            "resuming from %s, which was written with other versions (checkpoint -> now): %s; the run goes on, "
            "but its numbers may differ from an uninterrupted run's",
            checkpoint,
            "; ".join(changes),
        )
    return changes
