"""Greedy accuracy on held-out rows every `interval` rollout steps and at the end: `eval/accuracy`."""

from __future__ import annotations

import logging
import time

import lightning as L

from lit_grpo.module import trained
from lit_grpo.rollout import row_prompt_tokens

log = logging.getLogger(__name__)


def greedy_accuracy(sampler, tokenizer, rows: list[dict], reward_fn, max_tokens: int, batch_size: int) -> float:
    """Mean reward of one greedy completion per row (for a 0/1 reward: the accuracy)."""
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        completions = sampler.generate([row_prompt_tokens(r, tokenizer) for r in chunk], 0.0, max_tokens)
        total += sum(reward_fn(c.text, row) for c, row in zip(completions, chunk))
    return total / len(rows)


class GreedyEvaluation(L.Callback):
    """Scores the sampler (which holds the policy after each weight sync) on the data module's
    `eval_rows` with greedy decoding; logged as `eval/accuracy` with the step's metrics, and
    after the last step. Runs after the weight sync: it follows it in the callback list."""

    def __init__(self, interval: int = 0, max_tokens: int = 256, batch_size: int = 64) -> None:
        self.interval, self.max_tokens, self.batch_size = interval, max_tokens, batch_size
        self.last: dict[str, float] = {}
        """The latest `eval/accuracy` (and its step), for the run summary."""

    def _evaluate(self, trainer: L.Trainer, step: int) -> float | None:
        dm = trainer.datamodule
        if not dm.eval_rows or dm.reward_fn is None:
            return None
        start = time.perf_counter()
        accuracy = greedy_accuracy(dm.sampler, dm.tokenizer, dm.eval_rows, dm.reward_fn, self.max_tokens, self.batch_size)
        self.last = {"eval/accuracy": accuracy, "eval/step": float(step)}
        log.info("step %d: eval/accuracy %.4f on %d held-out rows (%.1f s)", step, accuracy, len(dm.eval_rows), time.perf_counter() - start)
        return accuracy

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = pl_module.rollout_step
        if not trained(outputs) or self.interval <= 0 or step % self.interval:
            return
        accuracy = self._evaluate(trainer, step)
        if accuracy is not None:
            pl_module.record({"eval/accuracy": accuracy})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = pl_module.rollout_step
        if step == 0 or self.last.get("eval/step") == float(step):
            return  # nothing trained, or this step was just evaluated
        accuracy = self._evaluate(trainer, step)
        if accuracy is not None:
            for logger in trainer.loggers:
                logger.log_metrics({"eval/accuracy": accuracy}, step=step - 1)

    def state_dict(self) -> dict:
        return {"last": dict(self.last)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last = dict(state_dict["last"])
