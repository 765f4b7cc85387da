"""What the policy writes: every N steps, a table of the step's sampled completions (prompt,
completion, reward, advantage, finish reason, policy version) appended to `samples.jsonl` in the
run folder, logged to W&B as a table and to TensorBoard as text. Rank 0 logs its own samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from lit_grpo.tasks.rows import prompt_text
from lit_grpo.types import PromptGroup

COLUMNS = ("step", "prompt", "completion", "reward", "advantage", "finish_reason", "version")


def sample_table(
    groups: list[PromptGroup], advantages: list[float], step: int, tokenizer: Any, limit: int
) -> list[dict]:
    """One dict per trained sequence (at most `limit`), in batch order; `advantages` per sequence."""
    table: list[dict] = []
    i = 0
    for group in groups:
        prompt = prompt_text(group.row, tokenizer)
        for sample in group.samples:
            if len(table) >= limit:
                return table
            completion = sample.text
            if not completion and tokenizer is not None:
                completion = tokenizer.decode([t for t, m in zip(sample.tokens, sample.loss_mask) if m])
            table.append(
                {
                    "step": step,
                    "prompt": prompt,
                    "completion": completion,
                    "reward": float(sample.reward),
                    "advantage": float(advantages[i]),
                    "finish_reason": sample.finish_reason,
                    "version": group.version,
                }
            )
            i += 1
    return table


def markdown(table: list[dict]) -> str:
    """The table as Markdown (TensorBoard renders text summaries as Markdown)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "⏎")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row[c]) for c in COLUMNS) + " |" for row in table]
    return "\n".join(lines)


class SampleLog(L.Callback):
    """Every `every_n_steps` rollout steps, up to `max_samples` of the step's trained sequences."""

    def __init__(
        self, output_dir: str = ".", every_n_steps: int = 10, max_samples: int = 16, filename: str = "samples.jsonl"
    ) -> None:
        if every_n_steps < 0 or max_samples < 1:
            raise ValueError(
                f"SampleLog needs every_n_steps >= 0 (0: off) and max_samples >= 1, got {every_n_steps}, {max_samples}"
            )
        self.path = Path(output_dir) / filename
        self.every_n_steps, self.max_samples = every_n_steps, max_samples

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        step = pl_module.rollout_step
        if not outputs or self.every_n_steps == 0 or step % self.every_n_steps or not trainer.is_global_zero:
            return
        trained = pl_module.last_step
        if trained is None or not trained.groups:
            return
        table = sample_table(
            trained.groups, trained.advantages_B.tolist(), step, trainer.datamodule.tokenizer, self.max_samples
        )
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in table)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("samples", markdown(table), global_step=step - 1)
            elif isinstance(logger, WandbLogger):
                logger.log_text(
                    key="samples",
                    columns=list(COLUMNS),
                    data=[[row[c] for c in COLUMNS] for row in table],
                    step=step - 1,
                )
