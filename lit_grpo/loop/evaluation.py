"""Greedy accuracy on held-out rows: `eval/accuracy`, every `interval` rollout steps and at the end.

Run by the step sequence after the weight sync, so it scores the sampler holding the policy just
trained. Under data parallelism each rank scores its share of the rows and the sums are reduced.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from lit_grpo.loop.distributed import all_reduce
from lit_grpo.rollouts.rollout import row_prompt_tokens

log = logging.getLogger(__name__)


def greedy_reward_sum(sampler, tokenizer, rows: list[dict], reward_fn, max_tokens: int, batch_size: int,
                      prompt_field: Optional[str] = None) -> tuple[float, int]:
    """Sum of the rewards of one greedy completion per row, and how many rows were scored (a
    reward of None, not applicable to its row, counts in neither). Prompts are made as the
    default rollout makes them (`row_prompt_tokens`)."""
    total, scored = 0.0, 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        completions = sampler.generate([row_prompt_tokens(r, tokenizer, prompt_field) for r in chunk], 0.0, max_tokens)
        for c, row in zip(completions, chunk):
            reward = reward_fn(c.text, row)
            if reward is not None:
                total, scored = total + float(reward), scored + 1
    return total, scored


def greedy_accuracy(sampler, tokenizer, rows: list[dict], reward_fn, max_tokens: int, batch_size: int,
                    prompt_field: Optional[str] = None) -> float:
    """Mean reward of one greedy completion per row the reward applies to (for a 0/1 reward: the accuracy)."""
    total, scored = greedy_reward_sum(sampler, tokenizer, rows, reward_fn, max_tokens, batch_size, prompt_field)
    return total / scored if scored else float("nan")


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
        prompt_field = getattr(datamodule, "prompt_field", None)
        total, scored = greedy_reward_sum(
            datamodule.sampler, datamodule.tokenizer, share, datamodule.reward_fn, self.max_tokens, self.batch_size, prompt_field,
        ) if share else (0.0, 0)
        total, scored = all_reduce(torch.tensor([total, scored], dtype=torch.float64)).tolist()
        accuracy = total / scored if scored else float("nan")
        self.last = {"eval/accuracy": accuracy, "eval/step": float(step)}
        log.info("step %d: eval/accuracy %.4f on %d held-out rows (%d scored; the reward applies to those) (%.1f s)",
                 step, accuracy, len(rows), int(scored), time.perf_counter() - start)
        return accuracy

    def state_dict(self) -> dict:
        return {"last": dict(self.last)}

    def load_state_dict(self, state: dict) -> None:
        self.last = dict(state["last"])
