"""The rollout data module: an `IterableDataset` of `RolloutBatch`es made by a producer.

`RolloutDataModule` owns the sampler, the rollout function and the rows; its training dataloader
yields one batch per training step. The module pulls batches itself (see
`GRPOModule.training_step`) so no batch is sampled before the previous step's weights are synced.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from lit_grpo.producer import GroupFilter, RolloutProducer, RowCursor, collate_groups
from lit_grpo.producer_async import AsyncRolloutProducer
from lit_grpo.rollout import RolloutFn
from lit_grpo.types import RolloutBatch

__all__ = ["RolloutDataModule", "RolloutStream", "RolloutProducer", "RowCursor", "collate_groups", "GroupFilter"]


class RolloutStream(IterableDataset):
    """Yields one `RolloutBatch` per step until `max_steps` or the rows run out."""

    def __init__(self, producer: RolloutProducer, max_steps: int) -> None:
        self.producer, self.max_steps = producer, max_steps
        self.steps_done = 0
        self.rest_between_steps = None
        """Called once a step's rollouts are in (synchronous mode: lets a colocated engine sleep)."""

    def __iter__(self) -> Iterator[RolloutBatch]:
        while self.max_steps < 0 or self.steps_done < self.max_steps:
            batch = self.producer.next_batch()
            if batch is None:
                return
            if self.rest_between_steps is not None:
                self.rest_between_steps()
            self.steps_done += 1
            yield batch


class RolloutDataModule(L.LightningDataModule):
    """Streams rollouts from an in-process sampler; rows are tokenized with the policy's tokenizer."""

    def __init__(
        self,
        *,
        rows: list[dict],
        tokenizer,
        sampler,
        rollout_fn: RolloutFn,
        completions_per_prompt: int,
        prompt_groups_per_step: int,
        epochs: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        advantage_scale: str = "std",
        max_steps: int = -1,
        max_seq_len: int = 1 << 30,
        min_group_size: int = 2,
        synchronous_training: bool = True,
        max_head_offpolicy_versions: int = 0,
        max_concurrency: int = 256,
        eval_rows: Optional[list[dict]] = None,
        reward_fn: Optional[Callable[[str, dict], float]] = None,
    ) -> None:
        super().__init__()
        self.tokenizer, self.sampler = tokenizer, sampler
        self.eval_rows = [self._tokenized(r) for r in eval_rows or []]
        """Held-out rows for greedy evaluation (`prompt_token_ids` or `messages`)."""
        self.reward_fn = reward_fn
        """The task's `reward(completion_text, row)`, for evaluation."""
        self.group_filters: list[GroupFilter] = []
        self.cursor = RowCursor([self._tokenized(r) for r in rows], epochs, seed, shuffle)
        args = (self.cursor, rollout_fn, completions_per_prompt, prompt_groups_per_step, advantage_scale, tokenizer.pad_token_id, self.group_filters)
        checks = dict(max_seq_len=max_seq_len, min_group_size=min_group_size)
        if synchronous_training:
            self.producer = RolloutProducer(*args, **checks)
        else:
            self.producer = AsyncRolloutProducer(
                *args, **checks, max_head_offpolicy_versions=max_head_offpolicy_versions, max_concurrency=max_concurrency
            )
        self.stream = RolloutStream(self.producer, max_steps)
        if synchronous_training and hasattr(sampler, "sleep"):
            self.stream.rest_between_steps = sampler.sleep  # it wakes itself for the next sync or sample

    def _tokenized(self, row: dict) -> dict:
        if "prompt" in row and "prompt_token_ids" not in row:
            row = {**row, "prompt_token_ids": self.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]}
        return row

    def add_group_filter(self, keep: GroupFilter) -> None:
        """Accept a group only if `keep(group)` is True (and every other filter agrees)."""
        self.group_filters.append(keep)

    def sync_weights(self, named_tensors=None) -> None:
        """Load the policy's weights into the sampler (None: keep the sampler's weights, only
        advance the version, for `weight_sync_interval=0`); later rows are sampled at the next version."""
        if named_tensors is not None:
            self.sampler.update_weights(named_tensors)
        self.producer.advance_version()

    def state_dict(self) -> dict:
        """Steps done and the producer's data position, gate counters and version (between steps)."""
        return {"steps_done": self.stream.steps_done, "producer": self.producer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.steps_done = state["steps_done"]
        self.producer.load_state_dict(state["producer"])

    def close(self) -> None:
        """Stop the sampler's worker and the producer's event loop."""
        self.producer.close()  # first: in-flight rollouts still need the sampler to finish
        self.sampler.close()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, num_workers=0)
