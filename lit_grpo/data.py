"""The rollout stream: rows → rollout_fn × G → PromptGroup → filters → advantages → RolloutBatch.

`RolloutDataModule` owns the sampler, the rollout function and the rows; its training dataloader
is an `IterableDataset` that produces one `RolloutBatch` per training step. In this version the
producer is synchronous: the groups of a step are sampled concurrently (one batched generate),
then the step trains, then the weights sync. The module pulls batches itself (see
`GRPOModule.training_step`) so no batch is sampled before the previous step's weights are synced.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from typing import Callable, Iterator, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_grpo.advantages import ragged_group_advantages
from lit_grpo.rollout import RolloutFn
from lit_grpo.rollout_checks import CircuitBreaker, sample_problem
from lit_grpo.types import PromptGroup, RolloutBatch, RolloutSample

log = logging.getLogger(__name__)
GroupFilter = Callable[[PromptGroup], bool]


def collate_groups(groups: list[PromptGroup], advantages: list[list[float]], pad_id: int) -> RolloutBatch:
    """Right-pad the groups' samples into one batch; sequence i of group p gets advantages[p][i]."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.tokens) for s in samples)

    def padded(field: str, pad) -> list[list]:
        return [list(getattr(s, field)) + [pad] * (width - len(s.tokens)) for s in samples]

    tokens = torch.tensor(padded("tokens", pad_id), dtype=torch.long)
    attention = torch.tensor([[1] * len(s.tokens) + [0] * (width - len(s.tokens)) for s in samples], dtype=torch.long)
    loss_mask = torch.tensor(padded("loss_mask", 0), dtype=torch.float32)
    sampler_lp = torch.tensor(padded("logprobs", 0.0), dtype=torch.float32)
    return RolloutBatch(
        tokens_BT=tokens,
        attention_mask_BT=attention,
        loss_mask_BT=loss_mask,
        sampler_logprobs_BT=sampler_lp,
        advantages_B=torch.tensor([a for adv in advantages for a in adv], dtype=torch.float32),
        rewards_B=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        versions_B=torch.tensor([g.version for g in groups for _ in g.samples], dtype=torch.long),
    )


class RowCursor:
    """Rows in a seeded order per epoch; `(epoch, index)` is the position to resume from."""

    def __init__(self, rows: list[dict], epochs: int, seed: int, shuffle: bool) -> None:
        self.rows, self.epochs, self.seed, self.shuffle = rows, epochs, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict]:
        """Up to n next rows (fewer only when the last epoch ends)."""
        out = []
        while len(out) < n and self.epoch < self.epochs:
            if self.index >= len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
                continue
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out


class RolloutProducer:
    """Samples groups for a step until `prompt_groups_per_step` pass every group filter."""

    def __init__(
        self,
        cursor: RowCursor,
        rollout_fn: RolloutFn,
        completions_per_prompt: int,
        prompt_groups_per_step: int,
        advantage_scale: str,
        pad_id: int,
        group_filters: list[GroupFilter],
        *,
        max_seq_len: int = 1 << 30,
        min_group_size: int = 2,
    ) -> None:
        self.cursor, self.rollout_fn = cursor, rollout_fn
        self.G, self.P = completions_per_prompt, prompt_groups_per_step
        self.advantage_scale, self.pad_id = advantage_scale, pad_id
        self.group_filters = group_filters
        self.version = 0
        """Policy version of the sampler: the number of weight syncs so far."""
        self.accept_rate = 1.0
        """Running fraction of sampled groups that pass the filters (sizes the refill rounds)."""
        self.max_oversample = 4
        self._loop = asyncio.new_event_loop()  # one loop for the whole run: no per-step set-up
        self.max_seq_len, self.min_group_size = max_seq_len, min_group_size
        self.breaker = CircuitBreaker()
        self._step_counts: Counter = Counter()
        self._warned: set[str] = set()

    def close(self) -> None:
        self._loop.close()

    def _rows_to_request(self, missing: int) -> int:
        """Rows to sample for `missing` groups: more when the filters reject many, so a step
        needs few sampling rounds (each is a batched generate call). Accepted groups beyond
        the step's P are discarded rather than trained on later at a stale version."""
        return min(math.ceil(missing / max(self.accept_rate, 0.05)), self.P * self.max_oversample)

    async def _sample_group(self, row: dict, version: int) -> PromptGroup:
        results = await asyncio.gather(*(self.rollout_fn(row) for _ in range(self.G)), return_exceptions=True)
        samples = []
        for result in results:
            failed = isinstance(result, Exception)
            self.breaker.record(failed, result if failed else None)
            if failed:
                self._step_counts["rollout/failures"] += 1
                if self._step_counts["rollout/failures"] == 1:
                    log.warning("rollout_fn failed on row %s: %r", _row_label(row), result)
            elif result is not None:
                problem = sample_problem(result, self.max_seq_len)
                if problem is None:
                    samples.append(result)
                    continue
                self._step_counts[f"rollout/dropped_{problem}"] += 1
                if problem not in self._warned:
                    self._warned.add(problem)
                    log.warning("dropped a rollout sample of row %s: %s (counted as rollout/dropped_%s)", _row_label(row), problem, problem)
        return PromptGroup(row=row, samples=samples, version=version)

    async def _sample_rows(self, rows: list[dict]) -> list[PromptGroup]:
        return await asyncio.gather(*(self._sample_group(r, self.version) for r in rows))

    def next_batch(self) -> Optional[RolloutBatch]:
        """The next step's batch, or None when the rows are used up before any group was accepted."""
        start = time.perf_counter()
        accepted: list[PromptGroup] = []
        sampled: list[PromptGroup] = []
        self._step_counts = Counter({"rollout/failures": 0, "filter/dropped_groups": 0, "rollout/dropped_small_group": 0})
        while len(accepted) < self.P:
            rows = self.cursor.take(self._rows_to_request(self.P - len(accepted)))
            if not rows:
                break
            for group in self._loop.run_until_complete(self._sample_rows(rows)):
                sampled.append(group)
                if len(group.samples) < self.min_group_size:
                    self._step_counts["rollout/dropped_small_group"] += 1
                    keep = False
                elif not all(keep(group) for keep in self.group_filters):
                    self._step_counts["filter/dropped_groups"] += 1
                    keep = False
                else:
                    keep = True
                self.accept_rate = 0.9 * self.accept_rate + 0.1 * float(keep)
                if keep and len(accepted) < self.P:
                    accepted.append(group)
        if not accepted:
            return None
        advantages = ragged_group_advantages([g.rewards for g in accepted], self.advantage_scale)
        batch = collate_groups(accepted, advantages, self.pad_id)
        batch.stats = {**_rollout_stats(sampled, accepted, time.perf_counter() - start), **{k: float(v) for k, v in self._step_counts.items()}}
        return batch


def _row_label(row: dict) -> str:
    for key in ("id", "prompt", "question"):
        if key in row:
            return f"{key}={str(row[key])[:60]!r}"
    return "<row>"


def _rollout_stats(sampled: list[PromptGroup], accepted: list[PromptGroup], seconds: float) -> dict[str, float]:
    """Rewards over every sampled group (filtered ones included: they measure the policy too)."""
    rewards = [r for g in sampled for r in g.rewards]
    lengths = [sum(s.loss_mask) for g in sampled for s in g.samples]
    n = max(len(rewards), 1)
    mean = sum(rewards) / n
    generated = sum(lengths)
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(n - 1, 1)),
        "reward/max": max(rewards, default=0.0),
        "completion_len/mean": generated / n,
        "rollout/groups_accepted": float(len(accepted)),
        "perf/sample_s": seconds,
        "perf/sample_tokens_per_s": generated / max(seconds, 1e-9),
    }


class RolloutStream(IterableDataset):
    """Yields one `RolloutBatch` per step until `max_steps` or the rows run out."""

    def __init__(self, producer: RolloutProducer, max_steps: int) -> None:
        self.producer, self.max_steps = producer, max_steps
        self.steps_done = 0

    def __iter__(self) -> Iterator[RolloutBatch]:
        while self.max_steps < 0 or self.steps_done < self.max_steps:
            batch = self.producer.next_batch()
            if batch is None:
                return
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
    ) -> None:
        super().__init__()
        self.tokenizer, self.sampler = tokenizer, sampler
        self.group_filters: list[GroupFilter] = []
        self.cursor = RowCursor([self._tokenized(r) for r in rows], epochs, seed, shuffle)
        self.producer = RolloutProducer(
            self.cursor, rollout_fn, completions_per_prompt, prompt_groups_per_step, advantage_scale,
            tokenizer.pad_token_id, self.group_filters, max_seq_len=max_seq_len, min_group_size=min_group_size,
        )
        self.stream = RolloutStream(self.producer, max_steps)

    def _tokenized(self, row: dict) -> dict:
        if "prompt" in row and "prompt_token_ids" not in row:
            row = {**row, "prompt_token_ids": self.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]}
        return row

    def add_group_filter(self, keep: GroupFilter) -> None:
        """Accept a group only if `keep(group)` is True (and every other filter agrees)."""
        self.group_filters.append(keep)

    def sync_weights(self, named_tensors) -> None:
        """Load the policy's weights into the sampler; later rows are sampled at the next version."""
        self.sampler.update_weights(named_tensors)
        self.producer.version += 1

    def close(self) -> None:
        """Stop the sampler's worker and the producer's event loop."""
        self.sampler.close()
        self.producer.close()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, num_workers=0)
