"""Exports the trained policy in Hugging Face format when fit ends (the cookbook's `output_model_id`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lit_grpo.loop.step_sequence import check_finite
from lit_grpo.run.export import export_pretrained

log = logging.getLogger(__name__)


class HFExport(L.Callback):
    """Writes `<out_dir>` (safetensors + config + tokenizer) from the policy at the end of fit.

    Skipped under `fast_dev_run`. With several processes the shards are gathered first (a
    collective call on every rank); rank 0 writes. When `out_dir` cannot be written (a full disk,
    a folder taken away) the policy is saved to `rescue_dir` (in the run folder) instead and
    `problem` says so; `lit_grpo.train` writes the summary, then stops with that message.
    """

    def __init__(self, out_dir: str | Path, tokenizer, rescue_dir: str | Path | None = None) -> None:
        self.out_dir, self.tokenizer = Path(out_dir), tokenizer
        self.rescue_dir = None if rescue_dir is None else Path(rescue_dir)
        self.problem: str | None = None
        """Why the export did not reach `out_dir`, and where the policy went (None: it did)."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run or pl_module.rollout_step == 0 or getattr(pl_module.step_sequence, "stopping", False):
            return  # a smoke test, nothing trained, or stopped by a signal (not a final model)
        start = time.perf_counter()
        check_finite(pl_module.policy, f"export {self.out_dir}")
        full_state = None
        if trainer.world_size > 1:
            full_state = get_model_state_dict(
                pl_module.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if trainer.is_global_zero:
            try:
                export_pretrained(pl_module.policy, self.tokenizer, self.out_dir, state_dict=full_state)
                log.info("exported the trained policy to %s in %.2f s", self.out_dir, time.perf_counter() - start)
            except OSError as err:
                self.problem = self._rescue(pl_module, full_state, err)
                log.error("%s", self.problem)
        trainer.strategy.barrier("hf_export")

    def _rescue(self, pl_module: L.LightningModule, full_state, err: OSError) -> str:
        """Save the policy to `rescue_dir` after the export to `out_dir` failed with `err`; the message."""
        failed = f"the export to {self.out_dir} failed ({err.strerror or err})"
        if self.rescue_dir is None or self.rescue_dir == self.out_dir:
            return f"{failed}; the trained policy is in the run's last checkpoint, if one was saved"
        try:
            export_pretrained(pl_module.policy, self.tokenizer, self.rescue_dir, state_dict=full_state)
        except OSError as again:
            return f"{failed}, and so did the rescue to {self.rescue_dir} ({again.strerror or again})"
        return f"{failed}; the trained policy was saved to {self.rescue_dir} instead"
