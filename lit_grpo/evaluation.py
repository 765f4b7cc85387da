"""Greedy accuracy on held-out rows: `eval/accuracy`, every `interval` rollout steps and at the end.

Run by the step sequence after the weight sync, so it scores the sampler holding the policy just
trained. Under data parallelism each rank scores its share of the rows and the sums are reduced.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from lit_grpo.distributed import all_reduce
from lit_grpo.rollout import row_prompt_tokens

log = logging.getLogger(__name__)


def greedy_reward_sum(sampler, tokenizer, rows: list[dict], reward_fn, max_tokens: int, batch_size: int) -> float:
    """Sum of the rewards of one greedy completion per row."""
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        completions = sampler.generate([row_prompt_tokens(r, tokenizer) for r in chunk], 0.0, max_tokens)
        total += sum(reward_fn(c.text, row) for c, row in zip(completions, chunk))
    return total


def greedy_accuracy(sampler, tokenizer, rows: list[dict], reward_fn, max_tokens: int, batch_size: int) -> float:
    """Mean reward of one greedy completion per row (for a 0/1 reward: the accuracy)."""
    return greedy_reward_sum(sampler, tokenizer, rows, reward_fn, max_tokens, batch_size) / len(rows)


class GreedyEvaluator:
    """Scores the sampler on the data module's `eval_rows` with greedy decoding."""

    def __init__(self, interval: int = 0, max_tokens: int = 256, batch_size: int = 64) -> None:
        self.interval, self.max_tokens, self.batch_size = interval, max_tokens, batch_size
        self.last: dict[str, float] = {}
        """The latest `eval/accuracy` and its step, for the run summary."""

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def evaluate(self, datamodule, step: int, rank: int = 0, world_size: int = 1) -> Optional[float]:
        """`eval/accuracy` over all ranks' shares of the rows (a collective), or None without rows."""
        rows = datamodule.eval_rows
        if not rows or datamodule.reward_fn is None:
            return None
        start = time.perf_counter()
        share = rows[rank::world_size]
        total = greedy_reward_sum(datamodule.sampler, datamodule.tokenizer, share, datamodule.reward_fn, self.max_tokens, self.batch_size) if share else 0.0
        accuracy = float(all_reduce(torch.tensor(total, dtype=torch.float64))) / len(rows)
        self.last = {"eval/accuracy": accuracy, "eval/step": float(step)}
        log.info("step %d: eval/accuracy %.4f on %d held-out rows (%.1f s)", step, accuracy, len(rows), time.perf_counter() - start)
        return accuracy

    def state_dict(self) -> dict:
        return {"last": dict(self.last)}

    def load_state_dict(self, state: dict) -> None:
        self.last = dict(state["last"])
