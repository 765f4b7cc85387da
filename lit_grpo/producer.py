"""Producers turn rows into training batches: rows → rollout_fn × G → PromptGroup → checks →
filters → advantages → a padded `RolloutBatch`.

`RolloutProducer` is the synchronous one (`synchronous_training: true`): a step's groups are
sampled concurrently on an event loop owned by the trainer's thread, then the step trains, then
the weights sync; nothing is sampled while the trainer works.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections import Counter
from typing import Callable, Optional

import torch

from lit_grpo.advantages import ragged_group_advantages
from lit_grpo.rollout import RolloutFn
from lit_grpo.rollout_checks import CircuitBreaker, sample_problem
from lit_grpo.types import PromptGroup, RolloutBatch, RolloutSample

log = logging.getLogger(__name__)
GroupFilter = Callable[[PromptGroup], bool]
_ZERO_COUNTS = {"rollout/failures": 0, "filter/dropped_groups": 0, "rollout/dropped_small_group": 0}


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
    """Rows in a seeded order per epoch; `(epoch, index)` is the position to resume from.

    Positions handed out but not yet trained (rollouts in flight when a checkpoint is taken) go
    back into `replay` on resume and are served again before the cursor moves on.
    """

    def __init__(self, rows: list[dict], epochs: int, seed: int, shuffle: bool) -> None:
        self.rows, self.epochs, self.seed, self.shuffle = rows, epochs, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._order_of(0)
        self.replay: list[tuple[int, int]] = []

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def row_at(self, position: tuple[int, int]) -> dict:
        epoch, index = position
        order = self._order if epoch == self.epoch else self._order_of(epoch)
        return self.rows[order[index]]

    def take_positioned(self, n: int) -> list[tuple[tuple[int, int], dict]]:
        """Up to n next `(position, row)` pairs, replayed positions first (fewer only when the last epoch ends)."""
        out = []
        while self.replay and len(out) < n:
            position = self.replay.pop(0)
            out.append((position, self.row_at(position)))
        while len(out) < n and self.epoch < self.epochs:
            if self.index >= len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
                continue
            out.append(((self.epoch, self.index), self.rows[self._order[self.index]]))
            self.index += 1
        return out

    def take(self, n: int) -> list[dict]:
        """Up to n next rows (fewer only when the last epoch ends)."""
        return [row for _, row in self.take_positioned(n)]

    def state_dict(self, unfinished: list[tuple[int, int]] = ()) -> dict:
        """The position to resume from; `unfinished` positions are served again first."""
        return {
            "epoch": self.epoch, "index": self.index, "replay": sorted([*self.replay, *unfinished]),
            "num_rows": len(self.rows), "seed": self.seed, "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(f"the checkpoint's data cursor was saved with {key}={state[key]!r}, this run has {mine!r}")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._order_of(self.epoch)
        self.replay = [tuple(p) for p in state["replay"]]


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
        self._step_counts: Counter = Counter(_ZERO_COUNTS)
        self._counts_lock = threading.Lock()
        self._warned: set[str] = set()
        self.trainer_version = 0
        """The version the trainer is at (for staleness: trainer_version - group.version)."""
        self.trained_samples = 0
        """Samples (G per group) of the groups handed to the trainer so far."""

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
                if self._count("rollout/failures") == 1:
                    log.warning("rollout_fn failed on row %s: %r", _row_label(row), result)
            elif result is not None:
                problem = sample_problem(result, self.max_seq_len)
                if problem is None:
                    samples.append(result)
                    continue
                self._count(f"rollout/dropped_{problem}")
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
        while len(accepted) < self.P:
            rows = self.cursor.take(self._rows_to_request(self.P - len(accepted)))
            if not rows:
                break
            for group in self._loop.run_until_complete(self._sample_rows(rows)):
                sampled.append(group)
                keep = self._keep(group)
                self.accept_rate = 0.9 * self.accept_rate + 0.1 * float(keep)
                if keep and len(accepted) < self.P:
                    accepted.append(group)
        seconds = time.perf_counter() - start
        # Synchronous: the trainer waits for all of the sampling, and nothing overlaps.
        return self._make_batch(accepted, sampled, seconds, **{"perf/trainer_wait_s": seconds, "perf/overlap_ratio": 0.0})

    def _count(self, key: str) -> int:
        with self._counts_lock:
            self._step_counts[key] += 1
            return self._step_counts[key]

    def _keep(self, group: PromptGroup) -> bool:
        """Whether the group trains: enough valid samples, and every filter agrees."""
        if len(group.samples) < self.min_group_size:
            self._count("rollout/dropped_small_group")
            return False
        if not all(keep(group) for keep in self.group_filters):
            self._count("filter/dropped_groups")
            return False
        return True

    def _make_batch(self, accepted: list[PromptGroup], sampled: list[PromptGroup], seconds: float, **stats: float) -> Optional[RolloutBatch]:
        """Advantages, padding and the step's rollout statistics (counts since the last batch)."""
        if not accepted:
            return None
        self.trained_samples += self.G * len(accepted)
        advantages = ragged_group_advantages([g.rewards for g in accepted], self.advantage_scale)
        batch = collate_groups(accepted, advantages, self.pad_id)
        with self._counts_lock:
            counts, self._step_counts = self._step_counts, Counter(_ZERO_COUNTS)
        offsets = [self.trainer_version - g.version for g in accepted]
        batch.stats = {
            **_rollout_stats(sampled, accepted, seconds),
            **{k: float(v) for k, v in counts.items()},
            "async/filter_drops": float(counts["filter/dropped_groups"]),
            "async/version_offset_mean": sum(offsets) / len(offsets),
            "async/version_offset_max": float(max(offsets)),
            **stats,
        }
        return batch

    def advance_version(self) -> None:
        """The sampler now holds the next policy version (called by the trainer after a sync)."""
        self.version += 1
        self.trainer_version += 1

    def state_dict(self) -> dict:
        """What a resumed run needs to sample the same rows at the same versions (between steps)."""
        return {
            "version": self.version, "trainer_version": self.trainer_version, "accept_rate": self.accept_rate,
            "trained_samples": self.trained_samples, "cursor": self.cursor.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.version, self.trainer_version = state["version"], state["trainer_version"]
        self.accept_rate, self.trained_samples = state["accept_rate"], state["trained_samples"]
        self.cursor.load_state_dict(state["cursor"])


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


