"""The rollout pipeline as pure functions: rollout results → checked samples → PromptGroup →
group checks and filters → advantages → a padded `RolloutBatch`, and the step's rollout metrics.

    results of rollout_fn(row) × G ─► checked_samples ─► PromptGroup ─► group_verdict
        accepted groups ─► make_batch (advantages, padding) ─► RolloutBatch
        RolloutRecord of every rank ─► rollout_metrics (merged over ranks before logging)

Nothing here waits, samples or keeps state; the schedulers (`lit_grpo.rollouts.schedulers`)
decide when rows are sampled, and `GroupSampler` (`lit_grpo.rollouts.groups`) runs the calls.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Iterable, Optional

import torch

from lit_grpo.advantages import ragged_group_advantages
from lit_grpo.rollouts.checks import sample_problem
from lit_grpo.types import PromptGroup, RolloutBatch, RolloutRecord, RolloutSample

GroupFilter = Callable[[PromptGroup], bool]
"""A group predicate: True keeps the group (the seeds' `dynamic_filter_fn`)."""


def checked_samples(results: Iterable[object], max_seq_len: int) -> tuple[list[RolloutSample], Counter, Optional[BaseException]]:
    """The results of G rollout calls that can train, the count of each reason the others were
    dropped (`rollout/failures` for an exception, `rollout/dropped_<reason>` for a malformed
    sample; a None result is the rollout's own choice and is not counted), and the first exception."""
    samples: list[RolloutSample] = []
    counts: Counter = Counter()
    first_error = None
    for result in results:
        if isinstance(result, BaseException):
            counts["rollout/failures"] += 1
            first_error = first_error or result
        elif result is not None:
            problem = sample_problem(result, max_seq_len)
            if problem is None:
                samples.append(result)
            else:
                counts[f"rollout/dropped_{problem}"] += 1
    return samples, counts, first_error


def group_verdict(group: PromptGroup, min_group_size: int, filters: Iterable[GroupFilter]) -> Optional[str]:
    """None when the group trains, else the metric key that counts why not: too few valid
    samples (`rollout/dropped_small_group`) or a filter said no (`rollout/filtered_groups`)."""
    if len(group.samples) < min_group_size:
        return "rollout/dropped_small_group"
    if not all(keep(group) for keep in filters):
        return "rollout/filtered_groups"
    return None


def collate_groups(groups: list[PromptGroup], advantages: list[list[float]], pad_id: int) -> RolloutBatch:
    """Right-pad the groups' samples into one batch; sequence i of group p gets advantages[p][i]."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.tokens) for s in samples)

    def padded(field_name: str, pad) -> list[list]:
        return [list(getattr(s, field_name)) + [pad] * (width - len(s.tokens)) for s in samples]

    return RolloutBatch(
        tokens_BT=torch.tensor(padded("tokens", pad_id), dtype=torch.long),
        attention_mask_BT=torch.tensor([[1] * len(s.tokens) + [0] * (width - len(s.tokens)) for s in samples], dtype=torch.long),
        loss_mask_BT=torch.tensor(padded("loss_mask", 0), dtype=torch.float32),
        sampler_logprobs_BT=torch.tensor(padded("logprobs", 0.0), dtype=torch.float32),
        advantages_B=torch.tensor([a for adv in advantages for a in adv], dtype=torch.float32),
        rewards_B=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        versions_B=torch.tensor([g.version for g in groups for _ in g.samples], dtype=torch.long),
    )


def make_batch(accepted: list[PromptGroup], sampled: list[PromptGroup], *, version: int, advantage_scale: str,
               pad_id: int, counts: Counter, timings: dict[str, float]) -> RolloutBatch:
    """The step's batch of `accepted` groups, with its `RolloutRecord` (over every `sampled` group)
    attached. `version` is the trainer's policy version now. Needs at least one accepted group."""
    advantages = ragged_group_advantages([g.rewards for g in accepted], advantage_scale)
    batch = collate_groups(accepted, advantages, pad_id)
    batch.record = RolloutRecord(
        rewards=[r for g in sampled for r in g.rewards],
        completion_tokens=[sum(s.loss_mask) for g in sampled for s in g.samples],
        counts=Counter(counts),
        version_offsets=[version - g.version for g in accepted],
        timings=dict(timings),
    )
    return batch


def rollout_metrics(records: list[RolloutRecord]) -> dict[str, float]:
    """The rollout metrics of one step over every rank's record (a list of one without DDP).

    Rewards and lengths are pooled over all ranks' samples; counts add up; perf timings are the
    slowest rank's; `rollout/groups_accepted` is the groups trained on by all ranks together.
    """
    rewards = [r for rec in records for r in rec.rewards]
    lengths = [n for rec in records for n in rec.completion_tokens]
    offsets = [o for rec in records for o in rec.version_offsets]
    n = max(len(rewards), 1)
    mean = sum(rewards) / n
    metrics = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(n - 1, 1)),
        "reward/max": max(rewards, default=0.0),
        "rollout/completion_len_mean": sum(lengths) / max(len(lengths), 1),
        "rollout/groups_accepted": float(len(offsets)),
        "async/version_offset_mean": sum(offsets) / max(len(offsets), 1),
        "async/version_offset_max": float(max(offsets, default=0)),
    }
    counts: Counter = Counter({"rollout/failures": 0, "rollout/filtered_groups": 0, "rollout/dropped_small_group": 0})
    for rec in records:
        counts.update(rec.counts)
    metrics.update({key: float(value) for key, value in counts.items()})
    for key in {k for rec in records for k in rec.timings}:  # the step waits for the slowest rank
        metrics[key] = max(rec.timings[key] for rec in records if key in rec.timings)
    sample_s = metrics.get("perf/sample_s", 0.0)
    metrics["perf/sample_tokens_per_s"] = sum(lengths) / max(sample_s, 1e-9)
    return metrics
