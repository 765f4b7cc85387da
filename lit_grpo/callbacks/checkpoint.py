"""DCP checkpoints every `interval` rollout steps, and an exact resume from one.

What is saved at the end of a step (after its weight sync):
- with `torch.distributed.checkpoint` (sharded under FSDP, deduplicated under DDP): the policy and
  the optimizer state. The reference is not saved: it is the base model, rebuilt at start.
- per rank, in `trainer_state_rank<R>.pt`: the steps done, the LR schedule, the data module (data
  cursor, rows in flight, producer version and gate counters), every stateful callback (metric
  history, weight-sync counter, reward curve) and the RNG states (python, numpy, torch, CUDA).

A resumed run loads these before its first step and restores the RNG states just before it
samples, so a synchronous run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Optional

import lightning as L
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lit_grpo.callbacks.history import MetricHistory
from lit_grpo.checkpoint import CONFIG_FILE, CheckpointStore, config_as_dict, step_dir_name, trainer_state_file
from lit_grpo.module import trained

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


def capture_rng() -> dict:
    """Every RNG a step draws from: python, numpy, torch CPU and (when present) each CUDA device."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class DCPCheckpoint(Checkpoint):
    """Saves a resumable checkpoint every `interval` rollout steps and after the last; resumes from `resume_from`.

    A Lightning `Checkpoint`, so it runs after every other callback of a step (the weight sync
    and the metric history included).
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        interval: int,
        run_config,
        weight_sync_interval: int,
        resume_from: Optional[Path] = None,
    ) -> None:
        self.store, self.interval = store, interval
        self.run_config, self.weight_sync_interval = run_config, weight_sync_interval
        self.resume_from = resume_from
        self.last_saved_step: Optional[int] = None
        self._rng_to_restore: Optional[dict] = None

    # ------------------------------------------------------------------ save

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not trained(outputs):
            return
        if self.interval > 0 and pl_module.rollout_step % self.interval == 0 and not trainer.fast_dev_run:
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = pl_module.rollout_step
        if self.interval > 0 and step > 0 and self.last_saved_step != step and not trainer.fast_dev_run:
            self.save(trainer, pl_module)

    def save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path:
        start = time.perf_counter()
        step = pl_module.rollout_step
        staging = self.store.staging_dir(step)
        if trainer.is_global_zero:
            self.store.begin(step)
        trainer.strategy.barrier("dcp_begin")
        model_sd, optim_sd = get_state_dict(pl_module.policy, trainer.optimizers)
        dcp.save({"policy": model_sd, "optimizer": optim_sd}, checkpoint_id=staging)
        torch.save(self._trainer_state(trainer, pl_module), staging / trainer_state_file(trainer.global_rank))
        trainer.strategy.barrier("dcp_written")
        final = self.store.root / step_dir_name(step)
        if trainer.is_global_zero:
            (staging / CONFIG_FILE).write_text(OmegaConf.to_yaml(config_as_dict(self.run_config)))
            final = self.store.publish(step, staging, {"world_size": trainer.world_size, "format": FORMAT_VERSION})
            self.store.prune()
        trainer.strategy.barrier("dcp_published")
        for logger in trainer.loggers:  # what the loggers hold is on disk too
            logger.save()
        self.last_saved_step = step
        if trainer.is_global_zero:
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _trainer_state(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        return {
            "format": FORMAT_VERSION,
            "step": pl_module.rollout_step,
            "world_size": trainer.world_size,
            "sampler_holds_policy": self.weight_sync_interval > 0 and pl_module.rollout_step % self.weight_sync_interval == 0,
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "datamodule": trainer.datamodule.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb is not self and cb.state_dict()},
            "rng": capture_rng(),
        }

    # ------------------------------------------------------------------ resume

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.resume_from is None:
            return
        path = self.resume_from
        state = torch.load(path / trainer_state_file(trainer.global_rank), weights_only=False, map_location="cpu")
        if state["world_size"] != trainer.world_size:
            raise RuntimeError(f"checkpoint {path} was written by {state['world_size']} processes; this run has {trainer.world_size}")
        model_sd, optim_sd = get_state_dict(pl_module.policy, trainer.optimizers)
        dcp.load({"policy": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
        set_state_dict(pl_module.policy, trainer.optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for config, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
            config.scheduler.load_state_dict(saved)
        trainer.datamodule.load_state_dict(state["datamodule"])
        for cb in trainer.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        self.last_saved_step = pl_module.rollout_step = state["step"]
        self._sync_sampler(trainer, pl_module, state["sampler_holds_policy"])
        self._rng_to_restore = state["rng"]
        self._replay_history_into_csv(trainer)
        log.info("resumed from %s at step %d", path, state["step"])

    def _sync_sampler(self, trainer: L.Trainer, pl_module: L.LightningModule, holds_policy: bool) -> None:
        """Give the fresh sampler the weights it held when the checkpoint was taken."""
        if self.weight_sync_interval == 0:
            return  # it never receives the policy: the base weights it starts with are right
        if not holds_policy:
            log.warning("the checkpoint was taken between weight syncs; the sampler restarts from the saved policy (not an exact resume)")
        with torch.no_grad():
            trainer.datamodule.sampler.update_weights(pl_module.policy.state_dict().items())

    @staticmethod
    def _replay_history_into_csv(trainer: L.Trainer) -> None:
        """Lightning's CSV logger starts a fresh metrics.csv; write the restored steps back into it."""
        history = next((cb for cb in trainer.callbacks if isinstance(cb, MetricHistory)), None)
        if history is None:
            return
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                for step, metrics in enumerate(history.steps):
                    logger.log_metrics(metrics, step=step)
                logger.save()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._rng_to_restore is not None:  # as late as possible: nothing between here and sampling draws
            restore_rng(self._rng_to_restore)
            self._rng_to_restore = None

    def state_dict(self) -> dict:
        return {}
