"""Checkpoint folders: atomic publication, verification, pruning, and picking one to resume from.

A checkpoint is a folder `<root>/step_NNNNNNNN/` holding

    .metadata, *.distcp          torch.distributed.checkpoint shards: policy + optimizer
    trainer_state_rank<R>.pt     per-rank state: loop, data cursor, producer, callbacks, RNG, LR schedule
    config.yaml                  the run's resolved config (what the state means)
    run_id.txt                   the id of the run that wrote it (also in the manifest)
    manifest.json                written last: every file's size and sha256, the step, the run id, the
                                 versions it ran on (`lit_grpo.run.provenance`)

It is written under `<root>/.tmp-step_NNNNNNNN/` and renamed into place only when complete, so a
crash mid-save leaves no folder under a checkpoint name. A folder whose manifest is missing or
disagrees with its files (a torn copy, a truncated file) is reported and skipped on resume.

Every checkpoint names the run that wrote it (a fresh run draws a new id; a resumed run keeps the
id of the checkpoint it resumed from). A store prunes only its own run's verified checkpoints:
another run's folders, and folders it cannot attribute, are never deleted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional, get_type_hints

from omegaconf import OmegaConf

from lit_grpo.config import ConfigError, TrainConfig
from lit_grpo.config.moved import rename_saved
from lit_grpo.config.sources import sha256_of

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
RUN_ID_FILE = "run_id.txt"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"


def state_defining_fields(schema: type = TrainConfig, prefix: str = "") -> tuple[str, ...]:
    """Dotted names of the fields of `schema` and its sub-configs marked `DEFINES_STATE` where
    lit_grpo/config/run.py declares them; a marked sub-config is named alone and covers all below it."""
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
        files[str(path.relative_to(folder))] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    tmp = folder / (MANIFEST + ".part")
    tmp.write_text(json.dumps({**meta, "files": files}, indent=1))
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)
    _fsync_dir(folder)


def missing_manifest(folder: Path) -> str:
    """Why `folder` has no manifest. Saves are published whole (renamed from their staging folder
    with the manifest inside), so a step folder without one was not left by an unfinished save:
    it holds a checkpoint's files (written before checkpoints had manifests, or copied without it),
    or it is not a checkpoint at all."""
    if (folder / ".metadata").is_file() or any(folder.glob("trainer_state*.pt")):
        return (
            "no manifest.json: its files are a checkpoint's, written by a lit_grpo from before checkpoint "
            "manifests (or copied without it), which this version does not resume"
        )
    return "no manifest.json, and no checkpoint files: not a checkpoint lit_grpo wrote (or a copy that did not finish)"


def read_manifest(folder: Path) -> tuple[Optional[dict], Optional[str]]:
    """`folder`'s manifest as a dict whose `files` is a dict, or None and what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None, missing_manifest(folder)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        return None, f"unreadable manifest.json ({err})"
    if not isinstance(manifest, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
            type(manifest), "null"
        )
        return None, f"manifest.json holds a JSON {kind}, not an object"
    if not isinstance(manifest.get("files"), dict):
        return None, "manifest.json has no `files` object"
    return manifest, None


def run_id_of(folder: Path) -> Optional[str]:
    """The id of the run that wrote checkpoint `folder`, from its manifest (None: unreadable, or
    written before checkpoints carried one). Reads the manifest only: no hashing."""
    manifest, _ = read_manifest(folder)
    run_id = manifest.get("run_id") if manifest else None
    return run_id if isinstance(run_id, str) and run_id else None


def new_run_id() -> str:
    return uuid.uuid4().hex


def verify(folder: Path) -> Optional[str]:
    """None when `folder` is a complete checkpoint, else what is wrong with it."""
    manifest, problem = read_manifest(folder)
    if problem is not None or manifest is None:
        return problem or "no manifest"
    files = manifest["files"]
    for required in (".metadata", CONFIG_FILE, trainer_state_file(0)):
        if required not in files:
            return f"the manifest lists no {required}"
    for name, expected in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"the manifest lists {name!r}, outside the checkpoint"
        if not (
            isinstance(expected, dict)
            and isinstance(expected.get("bytes"), int)
            and isinstance(expected.get("sha256"), str)
        ):
            return f"the manifest's entry for {name} is not {{bytes, sha256}}"
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if sha256_of(path) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


class CheckpointStore:
    """The checkpoint folders of run `run_id` under `root` (a new id when none is given); rank 0
    publishes and prunes. Other runs' folders under `root` are read, never deleted."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, run_id: Optional[str] = None) -> None:
        self.root, self.keep_last = Path(root), keep_last
        self.run_id = run_id or new_run_id()
        self._verified: dict[tuple[Path, int], bool] = {}  # (folder, manifest mtime) -> verifies
        self._reported: set[Path] = set()

    def staging_dir(self, step: int) -> Path:
        return self.root / f"{TMP_PREFIX}{step_dir_name(step)}"

    def begin(self, step: int) -> Path:
        """An empty staging folder for `step`, marked with this run's id (rank 0; others wait at a
        barrier before writing)."""
        staging = self.staging_dir(step)
        if staging.exists():
            shutil.rmtree(staging)  # left by a save that was killed
        staging.mkdir(parents=True)
        (staging / RUN_ID_FILE).write_text(self.run_id)
        return staging

    def publish(self, step: int, staging: Path, meta: dict) -> Path:
        """Seal `staging` with its manifest and rename it to its final name (rank 0)."""
        write_manifest(staging, {"step": step, "run_id": self.run_id, **meta})
        final = self.root / step_dir_name(step)
        if final.exists():  # e.g. a corrupt checkpoint of this step, found and skipped on resume
            if run_id_of(final) == self.run_id:
                self._remove(final)
            else:  # not provably ours: kept under a name no resume or prune looks at
                aside = self.root / f"{final.name}.displaced-{time.strftime('%Y%m%d-%H%M%S')}"
                final.rename(aside)
                log.warning(
                    "checkpoint folder %s was not written by this run (%s); moved to %s", final, self.run_id, aside
                )
        staging.rename(final)
        _fsync_dir(self.root)
        self.mark_verified(final)  # its manifest was just computed from these files
        return final

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Checkpoint folders by step, oldest first (complete or not, of any run)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
        return sorted(found)

    def mark_verified(self, folder: Path) -> None:
        """Record that `folder` verifies (it was just written, or verified when the run resumed from it)."""
        self._verified[(folder, (folder / MANIFEST).stat().st_mtime_ns)] = True

    def _verifies(self, folder: Path) -> bool:
        """`verify(folder) is None`, hashing each folder once per store: a run's own checkpoints
        were verified when published, so a prune hashes nothing in a steady run."""
        key = (folder, (folder / MANIFEST).stat().st_mtime_ns)
        if key not in self._verified:
            problem = verify(folder)
            if problem is not None and folder not in self._reported:
                self._reported.add(folder)
                log.warning(
                    "checkpoint %s of this run does not verify (%s); pruning leaves it in place", folder, problem
                )
            self._verified[key] = problem is None
        return self._verified[key]

    def _remove(self, path: Path) -> None:
        # Off its checkpoint name first, so a kill mid-delete leaves no torn step folder.
        doomed = self.root / f"{TMP_PREFIX}old-{path.name}"
        shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def prune(self) -> None:
        """Keep this run's newest `keep_last` verified checkpoints and delete its older verified
        ones, plus abandoned staging folders of this run. Another run's folders, folders whose
        manifest names no run, and this run's folders that do not verify are left in place."""
        kept = 0
        for _, path in reversed(self.step_dirs()):
            if run_id_of(path) != self.run_id or not self._verifies(path):
                continue
            if kept < self.keep_last:
                kept += 1
            else:
                self._remove(path)
        for path in self.root.glob(f"{TMP_PREFIX}*"):
            if path.name.startswith(f"{TMP_PREFIX}old-") or _staging_run_id(path) == self.run_id:
                shutil.rmtree(path, ignore_errors=True)  # a deletion or a save that was killed

    def newest_complete(self) -> Optional[Path]:
        """The newest checkpoint that verifies; newer broken ones are reported and skipped."""
        for _, path in reversed(self.step_dirs()):
            problem = verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is incomplete or corrupt (%s); trying the previous one", path, problem)
        return None


def _staging_run_id(staging: Path) -> Optional[str]:
    try:
        return (staging / RUN_ID_FILE).read_text().strip() or None
    except OSError:
        return None


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint at `path`: that checkpoint (it must verify), or the newest complete one
    in a folder of them (a run's `checkpoints/` folder or the run folder itself).

    Raises `FileNotFoundError` or `ValueError` saying what is wrong.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist (give a checkpoint folder, a run's checkpoints/ folder or its run folder)"
        )
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


def config_as_dict(c: TrainConfig) -> dict:
    return _as_dict(OmegaConf.structured(c))


def _as_dict(node: Any) -> dict:
    """An OmegaConf mapping node as a plain dict, interpolations resolved."""
    value = OmegaConf.to_container(node, resolve=True)
    assert isinstance(value, dict), f"expected a mapping, got {type(value).__name__}"
    return value


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
    # A checkpoint saved before keys moved (`lit_grpo.config.moved`) is read under today's names.
    saved = rename_saved(_flatten(_as_dict(OmegaConf.load(checkpoint / CONFIG_FILE))))
    now = _flatten(config_as_dict(c))
    # A field added after the checkpoint was saved had, in effect, its default value then.
    defaults = _flatten(config_as_dict(type(c)()))
    saved.update({k: defaults[k] for k in now.keys() - saved.keys() if k in defaults})
    differing = sorted(k for k in saved.keys() | now.keys() if saved.get(k, "<unset>") != now.get(k, "<unset>"))
    refused = [k for k in differing if _state_defining(k)]
    if refused:
        details = "; ".join(
            f"{k}: {saved.get(k, '<unset>')!r} in the checkpoint, {now.get(k, '<unset>')!r} now" for k in refused
        )
        raise ConfigError(
            f"cannot resume from {checkpoint}: these fields change what its state means: {details}. "
            "Resume with the checkpoint's values, or start a new run in another folder "
            "(resume=null with another hydra.run.dir, or output_dir)."
        )
    allowed = [k for k in differing if k not in ("resume", "output_dir")]
    if allowed:
        log.info("resuming from %s with changed fields: %s", checkpoint, ", ".join(allowed))
