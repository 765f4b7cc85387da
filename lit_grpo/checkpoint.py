"""Checkpoint folders: atomic publication, verification, pruning, and picking one to resume from.

A checkpoint is a folder `<root>/step_NNNNNNNN/` holding

    .metadata, *.distcp          torch.distributed.checkpoint shards: policy + optimizer
    trainer_state_rank<R>.pt     per-rank state: loop, data cursor, producer, callbacks, RNG, LR schedule
    config.yaml                  the run's resolved config (what the state means)
    manifest.json                written last: every file's size and sha256

It is written under `<root>/.tmp-step_NNNNNNNN/` and renamed into place only when complete, so a
crash mid-save leaves no folder under a checkpoint name. A folder whose manifest is missing or
disagrees with its files (a torn copy, a truncated file) is reported and skipped on resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional, get_type_hints

from omegaconf import OmegaConf

from lit_grpo.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"


def state_defining_fields(schema: type = TrainConfig, prefix: str = "") -> tuple[str, ...]:
    """Dotted names of the fields of `schema` and its sub-configs marked `DEFINES_STATE` where
    lit_grpo/config.py declares them; a marked sub-config is named alone and covers all below it."""
    hints = get_type_hints(schema)
    names: list[str] = []
    for f in dataclasses.fields(schema):
        if f.metadata.get("defines_state"):
            names.append(prefix + f.name)
        elif dataclasses.is_dataclass(hints[f.name]):
            names.extend(state_defining_fields(hints[f.name], f"{prefix}{f.name}."))
    return tuple(names)


# Fields whose change makes a checkpoint mean something else: resuming with a different value is
# refused (`check_resumable`). A name covers the whole group below it (`model`, `task`).
STATE_DEFINING_FIELDS = state_defining_fields()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def trainer_state_file(rank: int) -> str:
    return f"trainer_state_rank{rank}.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, meta: dict) -> None:
    """Record every file's size and hash (and `meta`), fsync them all; the manifest goes last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[str(path.relative_to(folder))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    tmp = folder / (MANIFEST + ".part")
    tmp.write_text(json.dumps({**meta, "files": files}, indent=1))
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)
    _fsync_dir(folder)


def verify(folder: Path) -> Optional[str]:
    """None when `folder` is a complete checkpoint, else what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest.json ({err})"
    for required in (".metadata", CONFIG_FILE, trainer_state_file(0)):
        if required not in files:
            return f"the manifest lists no {required}"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


class CheckpointStore:
    """The checkpoint folders of one run under `root`; rank 0 publishes and prunes."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2) -> None:
        self.root, self.keep_last = Path(root), keep_last

    def staging_dir(self, step: int) -> Path:
        return self.root / f"{TMP_PREFIX}{step_dir_name(step)}"

    def begin(self, step: int) -> Path:
        """An empty staging folder for `step` (rank 0; others wait at a barrier before writing)."""
        staging = self.staging_dir(step)
        if staging.exists():
            shutil.rmtree(staging)  # left by a save that was killed
        staging.mkdir(parents=True)
        return staging

    def publish(self, step: int, staging: Path, meta: dict) -> Path:
        """Seal `staging` with its manifest and rename it to its final name (rank 0)."""
        write_manifest(staging, {"step": step, **meta})
        final = self.root / step_dir_name(step)
        if final.exists():  # e.g. a corrupt checkpoint of this step, found and skipped on resume
            displaced = self.root / f"{TMP_PREFIX}old-{final.name}"
            shutil.rmtree(displaced, ignore_errors=True)
            final.rename(displaced)
            shutil.rmtree(displaced)
        staging.rename(final)
        _fsync_dir(self.root)
        return final

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Checkpoint folders by step, oldest first (complete or not)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
        return sorted(found)

    def prune(self) -> None:
        """Keep the newest `keep_last` checkpoints; drop older ones and abandoned staging folders."""
        for _, path in self.step_dirs()[: -self.keep_last]:
            # Off its checkpoint name first, so a kill mid-delete leaves no torn step folder.
            doomed = self.root / f"{TMP_PREFIX}old-{path.name}"
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        for path in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)

    def newest_complete(self) -> Optional[Path]:
        """The newest checkpoint that verifies; newer broken ones are reported and skipped."""
        for _, path in reversed(self.step_dirs()):
            problem = verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is incomplete or corrupt (%s); trying the previous one", path, problem)
        return None


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint at `path`: that checkpoint (it must verify), or the newest complete one
    in a folder of them (a run's `checkpoints/` folder or the run folder itself).

    Raises `FileNotFoundError` or `ValueError` saying what is wrong.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (give a checkpoint folder, a run's checkpoints/ folder or its run folder)")
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        problem = verify(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} cannot be used: {problem}")
        return path
    for root in (path, path / "checkpoints"):
        found = CheckpointStore(root).newest_complete()
        if found is not None:
            return found
    raise ValueError(f"no complete checkpoint under {path}")


def find_resume_checkpoint(resume: Optional[str], output_dir: str) -> Optional[Path]:
    """The checkpoint `resume` designates (None: start fresh). `auto` looks in
    `<output_dir>/checkpoints` and starts fresh when there is none; a path goes to `locate_checkpoint`."""
    if resume is None:
        return None
    if resume == "auto":
        found = CheckpointStore(Path(output_dir) / "checkpoints").newest_complete()
        if found is None:
            log.info("resume=auto: no complete checkpoint in %s, starting fresh", Path(output_dir) / "checkpoints")
        return found
    try:
        return locate_checkpoint(resume)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"config field `resume`: {err}") from None


def config_as_dict(c: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(c), resolve=True)


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _state_defining(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in STATE_DEFINING_FIELDS)


def check_resumable(checkpoint: Path, c: TrainConfig) -> None:
    """Refuse to resume when a field that defines what the saved state means has changed.

    Raises `ConfigError` naming every such field with both values; other differences (more
    steps, another logger) are allowed and logged.
    """
    saved = _flatten(OmegaConf.to_container(OmegaConf.load(checkpoint / CONFIG_FILE), resolve=True))
    now = _flatten(config_as_dict(c))
    differing = sorted(k for k in saved.keys() | now.keys() if saved.get(k, "<unset>") != now.get(k, "<unset>"))
    refused = [k for k in differing if _state_defining(k)]
    if refused:
        details = "; ".join(f"{k}: {saved.get(k, '<unset>')!r} in the checkpoint, {now.get(k, '<unset>')!r} now" for k in refused)
        raise ConfigError(
            f"cannot resume from {checkpoint}: these fields change what its state means: {details}. "
            "Resume with the checkpoint's values, or start a new run (resume=null or another output_dir)."
        )
    allowed = [k for k in differing if k not in ("resume", "output_dir")]
    if allowed:
        log.info("resuming from %s with changed fields: %s", checkpoint, ", ".join(allowed))
