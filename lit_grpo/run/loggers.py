"""Lightning loggers behind the optional extras they need, with an install hint that names the extra,
and the CSV logger that writes `<output_dir>/metrics.csv` into the run folder."""

from __future__ import annotations

import csv
import importlib
import os
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _RunFolderWriter(ExperimentWriter):
    """Lightning's CSV writer, for a run folder: an existing metrics.csv stays as it is until this
    run's first save replaces it whole (written beside it, then renamed into place).

    Lightning's writer deletes metrics.csv as it starts, and warns whenever its folder holds any
    file (the run folder always does: Hydra's `.hydra/` and log, the run lock). A resume that then
    failed (a server that refused it, a bad checkpoint) left the run folder without its metrics.
    `train` has settled whose file it is before the logger starts: a fresh run moves an earlier
    run's file aside (`run_folder.set_aside_metrics`), and a resume into its own folder rewrites it
    from the checkpoint's history (`StepSequence`), once the resume has gone through.
    """

    metrics: list[dict[str, float]]  # ExperimentWriter's rows not yet written
    _replaces_file: bool

    def _check_log_dir_exists(self) -> None:
        self._replaces_file = self._fs.isfile(self.metrics_file_path)

    def save(self) -> None:
        if not (self._replaces_file and self.metrics):
            return super().save()
        self._record_new_keys()
        path = Path(self.metrics_file_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(self.metrics)
        os.replace(tmp, path)
        self._replaces_file, self.metrics = False, []


class RunFolderCSVLogger(CSVLogger):
    """`CSVLogger` for the run folder itself (`conf/logger/csv.yaml`: `name: ""`, `version: ""`)."""

    _experiment: Optional[ExperimentWriter]

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _RunFolderWriter(log_dir=self.log_dir)
        return self._experiment


def _require(module: str, extra: str, what: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"logger={what} needs the `{extra}` extra: pip install 'lit_grpo[{extra}]' (or pick logger=csv)"
        ) from None


def wandb(
    *,
    project: str,
    save_dir: str,
    entity: str | None = None,
    name: str | None = None,
    offline: bool = False,
    **kwargs: Any,
):
    """`WandbLogger`; with `offline=True` (or WANDB_MODE=offline) it needs no account and writes
    `<save_dir>/wandb/offline-run-*` for `wandb sync` later."""
    _require("wandb", "wandb", "wandb")
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(project=project, entity=entity, name=name, save_dir=save_dir, offline=offline, **kwargs)


def tensorboard(*, save_dir: str, name: str = "tensorboard", **kwargs: Any):
    """`TensorBoardLogger` writing event files to `<save_dir>/<name>/`."""
    _require("tensorboard", "tensorboard", "tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=save_dir, name=name, version="", default_hp_metric=False, **kwargs)


def finish_runs(loggers) -> None:
    """End the W&B runs of a finished fit: in a process that trains again (a multirun sweep, a
    notebook) the next job would otherwise log into this job's run, and offline files are flushed."""
    from lightning.pytorch.loggers import WandbLogger  # importable without wandb

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:  # only runs that started
            logger.experiment.finish()
