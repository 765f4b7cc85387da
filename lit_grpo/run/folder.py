"""A run's output folder: one run at a time, and what a start may do with what is already there.

`train` claims the folder, decides how to start, and keeps the earlier run's metrics, before any
model loads:

    claim_output_dir(out)             an exclusive lock on <out>/.lit_grpo.lock for the whole run:
                                      a second run on the folder is refused at once, naming the holder;
                                      the file is removed when the run ends (a killed run's blocks nothing)
    find_resume_checkpoint(resume, out)
        resume=null                   fresh; refused when <out>/checkpoints holds checkpoints
        resume=auto                   the newest checkpoint there that verifies; none there: fresh;
                                      some there but none verifies: refused, naming each problem
        resume=<path>                 that checkpoint; refused when <out>/checkpoints holds another
                                      run's checkpoints, or later complete ones of the same run
    set_aside_metrics(out, resume_from)
                                      a fresh start moves an earlier run's metrics.csv to
                                      metrics.<time>.csv (Lightning's CSVLogger deletes metrics.csv)

Together they keep one invariant: an output folder's `checkpoints/` holds one run's checkpoints,
so `resume=auto` continues the run that wrote them, and pruning (by run id) never deletes another
run's work. Only the process launched as global rank 0 takes the lock or moves files: the other
ranks of a multi-process run start inside it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO, Optional

from lit_grpo.config import ConfigError
from lit_grpo.run.checkpoint import CheckpointStore, locate_checkpoint, read_manifest, run_id_of, verify

log = logging.getLogger(__name__)
LOCK_FILE = ".lit_grpo.lock"
METRICS_FILE = "metrics.csv"
CHECKPOINTS = "checkpoints"
# Set by the launchers of multi-process runs (Lightning, torchrun, SLURM, jsrun) in every process
# but the first; read before the trainer exists, which is when the folder is claimed.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
ELSEWHERE = "another folder (hydra.run.dir=<new folder>, or output_dir=<new folder> when calling train())"


def launched_as_rank_zero() -> bool:
    """Whether this process is the first of its run (every rank variable its launcher set is 0)."""
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in RANK_VARIABLES)


# ---------------------------------------------------------------------------------- the lock


class OutputDirLock:
    """An exclusive `flock` on `<output_dir>/.lit_grpo.lock`; the kernel drops it when the process
    dies, so a lock file left by a killed run blocks nothing. `held` is False on ranks other than
    0 and where the filesystem cannot lock."""

    def __init__(self, path: Path, file: Optional[IO[str]]) -> None:
        self.path, self._file = path, file

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        """Remove the lock file, then unlock: a run that ends (cleanly, refused or stopped) leaves no
        lock behind. The file is removed only while it is still the one this run locked (never a
        later run's lock); a run that opened it meanwhile finds it unlinked and claims again."""
        if self._file is not None:
            if _same_file(self.path, self._file):
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_output_dir(output_dir: str | os.PathLike) -> OutputDirLock:
    """Create `output_dir` and lock it for this run. Keep the handle for the whole run (`with`, or
    `.release()` at the end): a dropped handle closes the file and frees the lock.

    Raises `ConfigError` at once when another process holds it, naming that process.
    """
    out = Path(output_dir)
    path = out / LOCK_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir={out}: cannot write there ({err})") from None
    if not launched_as_rank_zero():
        return OutputDirLock(path, None)
    for _ in range(100):  # another attempt only when the file was removed by the run that released it
        lock = _try_lock(out, path)
        if lock is not None:
            return lock
    raise ConfigError(f"output_dir={out}: {path} keeps being removed and created again; is another run starting?")


def _same_file(path: Path, file: IO[str]) -> bool:
    """Whether `path` still names the file `file` has open."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    fst = os.fstat(file.fileno())
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _try_lock(out: Path, path: Path) -> Optional[OutputDirLock]:
    """Lock `path` for this run; None when the file locked was unlinked by a run that ended meanwhile."""
    try:
        file = path.open("a+")  # not truncated before the lock is ours: it names the holder
    except OSError as err:
        raise ConfigError(f"output_dir={out}: cannot write there ({err})") from None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read()
        file.close()
        raise ConfigError(
            f"output folder {out} is in use by another run: {_describe_holder(holder)} holds {path}. Two runs in one "
            f"folder would overwrite each other's checkpoints and metrics: wait for that run to end (or stop it), "
            f"or start this run in {ELSEWHERE}."
        ) from None
    except OSError as err:  # a filesystem without flock (some network mounts): run, unguarded
        file.close()
        log.warning("cannot lock %s (%s): a second run on this folder will not be detected", path, err)
        return OutputDirLock(path, None)
    if not _same_file(path, file):  # released and removed between our open and our lock: open the new one
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
        file.close()
        return None
    file.seek(0)
    file.truncate()
    file.write(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        + "\n"
    )
    file.flush()
    return OutputDirLock(path, file)


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        pid, host, since = int(holder["pid"]), str(holder["host"]), str(holder.get("since", "?"))
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"
    what = f"pid {pid} on host {host} (since {since})"
    if host == socket.gethostname() and not _alive(pid):
        what += ", no longer running: a process it started still holds the lock"
    return what


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------- the start


def _describe(folders: list[Path], limit: int = 6) -> str:
    """`step_00000006, step_00000008 (run 1a2b3c4d)`: folder names grouped by the run that wrote them."""
    by_run: dict[str, list[str]] = {}
    for folder in folders:
        run_id = run_id_of(folder)
        by_run.setdefault(f"run {run_id[:8]}" if run_id else "no run id", []).append(folder.name)
    parts = []
    for run, names in by_run.items():
        names.sort()
        shown = ", ".join(names[-limit:])
        more = f"{len(names) - limit} older and " if len(names) > limit else ""
        parts.append(f"{more}{shown} ({run})")
    return "; ".join(parts)


def check_fresh_start(output_dir: str | os.PathLike) -> None:
    """Refuse a fresh run (resume=null) in a folder whose `checkpoints/` holds checkpoints, whole or
    not (no hashing: it reads folder names and manifests). `ConfigError` names them and the fixes."""
    root = Path(output_dir) / CHECKPOINTS
    found = [path for _, path in CheckpointStore(root).step_dirs()]
    if found:
        raise ConfigError(
            f"output folder {output_dir} already holds checkpoints in {root}: {_describe(found)}. "
            "A fresh run (resume=null) "
            "there would mix its checkpoints with those. To continue that run: resume=auto. "
            f"To start a new run, use {ELSEWHERE}."
        )


def find_resume_checkpoint(resume: Optional[str], output_dir: str | os.PathLike) -> Optional[Path]:
    """The checkpoint this run resumes from (None: it starts fresh), or `ConfigError` saying why it may not start."""
    if resume is None:
        check_fresh_start(output_dir)
        return None
    root = Path(output_dir) / CHECKPOINTS
    if resume == "auto":
        return _newest_to_resume(root)
    try:
        checkpoint = locate_checkpoint(resume)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"config field `resume`: {err}") from None
    _check_resumes_into(checkpoint, root)
    return checkpoint


def _newest_to_resume(root: Path) -> Optional[Path]:
    """resume=auto: the newest checkpoint under `root` that verifies (newer broken ones reported)."""
    folders = [path for _, path in reversed(CheckpointStore(root).step_dirs())]
    if not folders:
        log.info("resume=auto: no checkpoint in %s, starting fresh", root)
        return None
    problems = []
    for path in folders:
        problem = verify(path)
        if problem is None:
            run_id = run_id_of(path)
            others = [p for p in folders if run_id_of(p) not in (run_id, None)]
            if others:
                log.warning(
                    "resume=auto: %s also holds other runs' checkpoints (%s); they are left in place",
                    root,
                    _describe(others),
                )
            return path
        log.warning("checkpoint %s is incomplete or corrupt (%s); trying the previous one", path, problem)
        problems.append(f"{path.name}: {problem}")
    raise ConfigError(
        f"resume=auto: {root} holds checkpoints but none is complete, so there is nothing to resume and a fresh start "
        f"there would bury them: {'; '.join(problems)}. "
        "Resume from a checkpoint elsewhere (resume=<path>), remove these "
        f"folders if they are not needed, or start a fresh run in {ELSEWHERE}."
    )


def _check_resumes_into(checkpoint: Path, root: Path) -> None:
    """resume=<path>: refuse when `root` holds checkpoints of another run, or later complete ones of
    the resumed run (a later resume=auto would continue those instead of this run). Only those
    later ones are hashed; a broken one of this run is replaced when this run saves that step."""
    manifest, _ = read_manifest(checkpoint)
    step, run_id = (manifest or {}).get("step"), run_id_of(checkpoint)
    in_the_way = []
    for other_step, path in CheckpointStore(root).step_dirs():
        other_id = run_id_of(path)
        if path.resolve() == checkpoint.resolve() or other_id is None:
            continue  # the checkpoint itself; or torn, or from before run ids: nothing a resume picks over ours
        if other_id != run_id or (isinstance(step, int) and other_step > step and verify(path) is None):
            in_the_way.append(path)
    if in_the_way:
        raise ConfigError(
            f"config field `resume`: cannot resume from {checkpoint} into {root.parent}: "
            "its checkpoints folder already holds "
            f"{_describe(in_the_way)}, which a later resume=auto there would continue instead of this run. "
            f"Move those checkpoints away, or resume into {ELSEWHERE}."
        )


# ---------------------------------------------------------------------------------- metrics


def set_aside_metrics(output_dir: str | os.PathLike, resume_from: Optional[Path]) -> Optional[Path]:
    """Move an earlier run's `metrics.csv` to `metrics.<its last write time>.csv`, unless this run
    resumes from this folder's own checkpoints (then the resume rewrites metrics.csv from the
    checkpoint's history). Returns where it went. Lightning's CSVLogger deletes metrics.csv when it
    starts; a fresh start must not take the earlier run's curve with it."""
    out = Path(output_dir)
    metrics = out / METRICS_FILE
    if not launched_as_rank_zero() or not metrics.is_file():
        return None
    if resume_from is not None and resume_from.resolve().parent == (out / CHECKPOINTS).resolve():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(metrics.stat().st_mtime))
    target, n = out / f"metrics.{stamp}.csv", 1
    while target.exists():
        target, n = out / f"metrics.{stamp}-{n}.csv", n + 1
    metrics.rename(target)
    log.warning(
        "%s held an earlier run's metrics; moved to %s (this run writes a new %s)", out, target.name, METRICS_FILE
    )
    return target
