"""A run's state saved with DCP every `interval` rollout steps, and loaded back for an exact resume.

What is saved (by the step sequence, after the step's weight sync):
- with `torch.distributed.checkpoint` (sharded under FSDP, deduplicated under DDP): the policy and
  the optimizer state; and the KL reference when it moves (`reference.sync_every` > 0). A frozen
  reference is not saved: it is the base model, rebuilt at start.
- per rank, in `trainer_state_rank<R>.pt`: the step, the run id, the LR schedules, the RNG states
  (python, numpy, torch, CUDA) and what the step sequence hands over (data cursor, rows in flight,
  scheduler version and gate counter, metric history, stateful callbacks). Only tensors and plain
  values (numbers, strings, lists, tuples, dicts): it is read with `torch.load(weights_only=True)`,
  so a checkpoint folder from elsewhere cannot run code when resumed from; one that holds any
  other object is refused (`UnsafeCheckpoint`).

Folders, manifests and pruning are `lit_grpo.run.checkpoint`'s job.
"""

from __future__ import annotations

import logging
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import lightning as L
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lit_grpo.errors import EnvironmentFault, UserError
from lit_grpo.run.checkpoint import (
    CONFIG_FILE,
    CheckpointStore,
    config_as_dict,
    run_id_of,
    step_dir_name,
    trainer_state_file,
)
from lit_grpo.run.provenance import run_versions

log = logging.getLogger(__name__)
FORMAT_VERSION = 3
"""3: the trainer state holds tensors and plain values only (read without unpickling objects)."""


class UnsafeCheckpoint(UserError):
    """A checkpoint's trainer state holds something other than tensors and plain values."""


def capture_rng() -> dict:
    """Every RNG a step draws from: python, numpy, torch CPU and (when present) each CUDA device."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy tuple: ("MT19937", keys, pos, has_gauss, gaussian)
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_trainer_state(file: Path) -> dict:
    """A rank's trainer state, unpickling nothing but tensors and plain values (`torch.load`'s
    `weights_only`): a file that needs more is refused, never run."""
    import pickle

    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        detail = str(err).split("WeightsUnpickler error: ")[-1].split(".")[0]
        raise UnsafeCheckpoint(
            f"checkpoint {file.parent}: {file.name} holds objects other than tensors and plain values "
            f"({detail}); lit_grpo does not unpickle them, since a checkpoint from elsewhere could run code "
            f"that way. Resume from a checkpoint written by this version of lit_grpo (format {FORMAT_VERSION})"
        ) from None


class CheckpointWriteError(EnvironmentFault):
    """A checkpoint could not be written (a full disk, a folder that went away); the message names
    the folder, the free space and the checkpoints kept."""


SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
"""What torch's zip writer says when a write comes up short (a full disk, a quota): it names no errno."""


def failure_chain(err: BaseException) -> list[BaseException]:
    """`err`, what it was raised from, and each rank's error inside a DCP `CheckpointException`."""
    seen: list[BaseException] = []
    todo: list[Optional[BaseException]] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in getattr(e, "failures", {}).values() if isinstance(pair, tuple)]
    return seen


def is_short_write(err: BaseException) -> bool:
    """Whether torch's writer failed to write all it had (its message; no errno)."""
    return any(any(text in str(e) for text in SHORT_WRITE) for e in failure_chain(err))


def write_failure_reason(err: BaseException) -> str:
    """Why a checkpoint could not be written, as a user reads it: the OS's words where an OSError in
    the chain has them ("No space left on device: <file>"), "No space left on device" where torch's
    writer fell short (it says `unexpected pos 704 vs 598`, its own position bookkeeping), else the
    last line of the error."""
    chain = failure_chain(err)
    for e in chain:
        if isinstance(e, OSError) and e.strerror:
            return e.strerror + (f": {e.filename}" if e.filename else "")
    for e in chain:
        if any(text in str(e) for text in SHORT_WRITE):
            last = str(e).strip().splitlines()[-1][:200]
            return f"No space left on device, or a quota reached: a write came up short ({last})"
    text = str(err).strip()
    return text.splitlines()[-1][:300] if text else type(err).__name__


class RunCheckpointer:
    """Saves and loads whole-run checkpoints in a `CheckpointStore` (a collective on every rank)."""

    def __init__(self, store: CheckpointStore, *, interval: int, run_config) -> None:
        self.store, self.interval, self.run_config = store, interval, run_config
        self.last_saved_step: Optional[int] = None
        self._run_id_agreed = False

    @property
    def run_id(self) -> str:
        """The id every checkpoint of this run carries (a resume adopts the checkpoint's)."""
        return self.store.run_id

    def due(self, trainer: L.Trainer, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0 and not trainer.fast_dev_run

    def due_at_end(self, trainer: L.Trainer, step: int) -> bool:
        """After the last step, unless it was just saved (or nothing was trained)."""
        return self.interval > 0 and step > 0 and self.last_saved_step != step and not trainer.fast_dev_run

    def save(
        self, trainer: L.Trainer, module: L.LightningModule, step: int, state: dict, rng: Optional[dict] = None
    ) -> Path:
        """Write step `step`'s checkpoint; `state` is this rank's part (picklable); `rng` the RNG
        states to save (None: the current ones)."""
        start = time.perf_counter()
        if not self._run_id_agreed:  # a fresh run's ranks each drew an id; rank 0's names the run
            self.store.run_id = trainer.strategy.broadcast(self.store.run_id, src=0)
            self._run_id_agreed = True
        staging = self.store.staging_dir(step)
        if trainer.is_global_zero:
            self.store.begin(step)
        trainer.strategy.barrier("dcp_begin")
        model_sd, optim_sd = get_state_dict(module.policy, trainer.optimizers)
        shards = {"policy": model_sd, "optimizer": optim_sd, **self._moving_reference(module)}
        try:
            return self._write(trainer, staging, step, shards, state, rng, start)
        except (OSError, CheckpointException, RuntimeError) as err:  # a full disk, a folder taken away
            if isinstance(err, RuntimeError) and not is_short_write(err):
                raise  # a bug, not the disk
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointWriteError(self._write_problem(step, err)) from None

    def _moving_reference(self, module: L.LightningModule) -> dict:
        """`{"reference": its state dict}` when the run's reference moves (it then differs from the
        base model a resume rebuilds); else nothing."""
        if not self.run_config.reference.moves or getattr(module, "reference", None) is None:
            return {}
        return {"reference": get_model_state_dict(module.reference)}

    def _write(self, trainer, staging: Path, step: int, shards: dict, state: dict, rng, start: float) -> Path:
        dcp.save(shards, checkpoint_id=staging)
        full_state = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": trainer.world_size,
            "run_id": self.store.run_id,
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "rng": rng if rng is not None else capture_rng(),
            **state,
        }
        torch.save(full_state, staging / trainer_state_file(trainer.global_rank))
        trainer.strategy.barrier("dcp_written")
        final = self.store.root / step_dir_name(step)
        if trainer.is_global_zero:
            (staging / CONFIG_FILE).write_text(OmegaConf.to_yaml(config_as_dict(self.run_config)))
            meta = {
                "world_size": trainer.world_size,
                "format": FORMAT_VERSION,
                "versions": run_versions(self.run_config.sampler.kind),
            }
            final = self.store.publish(step, staging, meta)  # the versions: a resume compares them with its own
            self.last_saved_step = step  # whole on disk now: a rank lost in the barrier below does not undo it
            self.store.prune()
        trainer.strategy.barrier("dcp_published")
        self.last_saved_step = step
        if trainer.is_global_zero:
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _write_problem(self, step: int, err: BaseException) -> str:
        root = self.store.root
        try:
            free = f"{shutil.disk_usage(root).free / 2**20:.0f} MiB free on its disk"
        except OSError:
            free = "its disk cannot be read"
        kept = sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
        reason = write_failure_reason(err)
        return (
            f"checkpoint {root / step_dir_name(step)} could not be written ({reason}); {free}. Its partial "
            f"folder was removed; the earlier checkpoints are kept ({', '.join(kept) or 'none'}). Free some "
            "space (or lower checkpoint.keep_last) and run again with resume=auto"
        )

    def load(self, path: Path, trainer: L.Trainer, module: L.LightningModule) -> dict:
        """Load the policy, the optimizer, a moving reference and the LR schedules from `path`; return this
        rank's state."""
        state = read_trainer_state(path / trainer_state_file(trainer.global_rank))
        if state.get("format") != FORMAT_VERSION:
            raise RuntimeError(
                f"checkpoint {path} has format {state.get('format')}, this version of lit_grpo reads {FORMAT_VERSION}"
            )
        if state["world_size"] != trainer.world_size:
            raise RuntimeError(
                f"checkpoint {path} was written by {state['world_size']} processes; this run has {trainer.world_size}"
            )
        model_sd, optim_sd = get_state_dict(module.policy, trainer.optimizers)
        reference = self._moving_reference(module)
        dcp.load({"policy": model_sd, "optimizer": optim_sd, **reference}, checkpoint_id=path)
        set_state_dict(module.policy, trainer.optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
        if reference:
            set_model_state_dict(module.reference, reference["reference"])
        for config, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
            config.scheduler.load_state_dict(saved)
        self.last_saved_step = state["step"]
        self._adopt_run(path)
        return state

    def _adopt_run(self, path: Path) -> None:
        """A resumed run keeps the id of the checkpoint it resumed from, so it prunes that run's
        older checkpoints (and nobody else's); `path` was verified when the run chose it."""
        run_id = run_id_of(path)
        if run_id is None:
            log.info(
                "checkpoint %s names no run (written by an older lit_grpo); this run is %s and leaves it in place",
                path,
                self.store.run_id,
            )
            return
        self.store.run_id, self._run_id_agreed = run_id, True
        if path.parent.resolve() == self.store.root.resolve():
            self.store.mark_verified(self.store.root / path.name)
