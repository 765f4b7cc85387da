"""The rollout pipeline as pure functions: rollout results → checked samples → PromptGroup →
group checks and filters → advantages → a padded `RolloutBatch`, and the step's rollout metrics.

    results of rollout_fn(row) × G ─► checked_samples ─► PromptGroup ─► group_verdict
        (a result is a RolloutSample, a RolloutRun of segments sharing one reward, or None)
        accepted groups ─► make_batch (advantages, padding) ─► RolloutBatch
        RolloutRecord of every rank ─► rollout_metrics (merged over ranks before logging)

Nothing here waits, samples or keeps state; the schedulers (`lit_grpo.rollouts.schedulers`,
`lit_grpo.rollouts.offpolicy`) decide when rows are sampled, and `GroupSampler`
(`lit_grpo.rollouts.groups`) runs the calls.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Optional

import torch

from lit_grpo.advantages.igpo import turn_metric_values
from lit_grpo.advantages.registry import Advantage, make_advantage, rewards_uniform
from lit_grpo.maths.health import rollout_health
from lit_grpo.rollouts.checks import check_sample, shown_type
from lit_grpo.samplers.arguments import PromptTooLong
from lit_grpo.tasks.images import PlaceholderInCompletion, RowImageError
from lit_grpo.types import MultiModalBatch, PromptGroup, RolloutBatch, RolloutRecord, RolloutRun, RolloutSample

_TYPECODES = {"q": torch.long, "f": torch.float32}
"""`array` typecodes of the padded batch tensors, and their torch dtypes."""

GroupFilter = Callable[[PromptGroup], bool]
"""A group predicate: True keeps the group (the cookbook's `dynamic_filter_fn`)."""


BAD_DATA_KEYS = frozenset({"rollout/dropped_bad_image"})
"""Drops that say the row's own data is bad (its image): each such row is named once, and the run's
end lists them, apart from the drops a policy's samples cause (`rollout/dropped_image_placeholder`)."""


def error_key(err: BaseException) -> str:
    """The metric key that counts a rollout call that ended in `err`: a prompt the sampler refused
    as too long is a drop (`rollout/dropped_prompt_too_long`), so is a row's image that cannot be
    used (`rollout/dropped_bad_image`) and a completion holding an image placeholder
    (`rollout/dropped_image_placeholder`), anything else a failure."""
    if isinstance(err, RowImageError):  # a missing or unreadable image: that row's sample is dropped
        return "rollout/dropped_bad_image"
    if isinstance(err, PlaceholderInCompletion):
        return "rollout/dropped_image_placeholder"
    return "rollout/dropped_prompt_too_long" if isinstance(err, PromptTooLong) else "rollout/failures"


def check_result(
    result: object, max_seq_len: int, vocab_size: Optional[int] = None, source: str = "the rollout function"
) -> tuple[list[RolloutSample], Optional[tuple[str, str]]]:
    """The trainable segments of one rollout call's result (a `RolloutSample`, or a `RolloutRun`
    of segments), or why it is dropped: `(metric key, detail)`. A run is kept whole or dropped
    whole: one malformed segment, or segments with different rewards, drop it. `source` names the
    rollout function (`module.name (file:line)`) in the detail of a result of the wrong type."""
    if isinstance(result, BaseException):
        return [], (error_key(result), str(result) if isinstance(result, RowImageError) else repr(result))
    if result is None:
        return [], ("rollout/dropped_none", "the rollout returned None")
    if not isinstance(result, (RolloutSample, RolloutRun)):
        expected = "expected a RolloutSample, a RolloutRun(segments=[...]) or None"
        return [], ("rollout/dropped_not_a_sample", f"{source} returned {shown_type(result)}; {expected}")
    segments = result.segments if isinstance(result, RolloutRun) else [result]
    if not isinstance(segments, (list, tuple)) or not segments:
        return [], ("rollout/dropped_empty_run", f"RolloutRun.segments is {segments!r:.60}")
    for i, segment in enumerate(segments):
        problem = check_sample(segment, max_seq_len, vocab_size)
        if problem is not None:
            where = f"segment {i}: " if isinstance(result, RolloutRun) else ""
            return [], (f"rollout/dropped_{problem[0]}", where + problem[1])
    rewards = {float(s.reward) for s in segments}
    if len(rewards) > 1:
        return [], ("rollout/dropped_segment_rewards_differ", f"segment rewards {sorted(rewards)[:4]}")
    return list(segments), None


def checked_samples(
    results: Iterable[object],
    max_seq_len: int,
    vocab_size: Optional[int] = None,
    source: str = "the rollout function",
) -> tuple[list[RolloutSample], list[int], Counter, dict[str, str]]:
    """The segments of G rollout calls that can train, the number of segments of each kept run,
    the count of each reason the other calls were dropped (`rollout/failures` for an exception,
    `rollout/dropped_none` for a None, `rollout/dropped_<reason>` for a malformed sample), and per
    key the first detail (for the warning; `source` names the rollout function, see `check_result`)."""
    samples: list[RolloutSample] = []
    run_sizes: list[int] = []
    counts: Counter = Counter()
    details: dict[str, str] = {}
    for result in results:
        segments, problem = check_result(result, max_seq_len, vocab_size, source)
        if problem is None:
            samples += segments
            run_sizes.append(len(segments))
            continue
        key, detail = problem
        counts[key] += 1
        details.setdefault(key, detail)
    return samples, run_sizes, counts, details


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 while `length` <= `max_length` -
    `buffer_len`, then falling linearly to `-factor` at `max_length`, and `-factor` beyond it (a
    multi-segment run can generate more than one call's limit). 0.0 when `buffer_len` is 0 (off)."""
    if buffer_len <= 0:
        return 0.0
    return factor * max(-1.0, min(0.0, (max_length - buffer_len - length) / buffer_len))


def penalize_overlong(
    samples: list[RolloutSample], run_sizes: list[int], max_length: int, buffer_len: int, factor: float
) -> list[RolloutSample]:
    """The samples with each run's `overlong_penalty` added to its reward and kept in its `metrics`
    as `reward/overlong_penalty` (logged as the step's mean). A run's length is the generated
    (loss-masked) tokens of all its segments; its segments keep one shared reward. The rollout's
    own objects are left as they were (copies are returned)."""
    penalized: list[RolloutSample] = []
    start = 0
    for size in run_sizes:
        run = samples[start : start + size]
        start += size
        penalty = overlong_penalty(sum(sum(s.loss_mask) for s in run), max_length, buffer_len, factor)
        penalized += [
            dataclasses.replace(
                s, reward=float(s.reward) + penalty, metrics={**s.metrics, "reward/overlong_penalty": penalty}
            )
            for s in run
        ]
    return penalized


def truncated_rows(samples: Iterable[RolloutSample]) -> list[int]:
    """Indices of the samples that hit the length limit (`finish_reason` `length`)."""
    return [i for i, s in enumerate(samples) if s.finish_reason == "length"]


def group_verdict(group: PromptGroup, min_group_size: int, filters: Iterable[GroupFilter]) -> Optional[str]:
    """None when the group trains, else the metric key that counts why not: too few valid
    samples (`rollout/dropped_small_group`) or a filter said no (`rollout/filtered_groups`)."""
    if len(group.rewards) < min_group_size:
        return "rollout/dropped_small_group"
    if not all(keep(group) for keep in filters):
        return "rollout/filtered_groups"
    return None


def collate_groups(
    groups: list[PromptGroup],
    advantages: list[list[float]],
    pad_id: int,
    token_advantages: Optional[list[list[float]]] = None,
) -> RolloutBatch:
    """Right-pad the groups' samples into one batch; sequence i of group p gets advantages[p][i].
    `token_advantages`: one list per sample (all groups' samples in order), one value per token,
    padded with 0 into `advantages_BT` (then `advantages` is ignored: `advantages_B` is the mean
    of each sequence's values on its trained tokens, for logs)."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.tokens) for s in samples)

    def padded(rows: Iterable[list], pad, typecode: str) -> torch.Tensor:
        # Through a flat `array`: about twice as fast as torch.tensor of the nested lists.
        flat: list = []
        for row in rows:
            flat += row
            flat += [pad] * (width - len(row))
        return torch.frombuffer(array(typecode, flat), dtype=_TYPECODES[typecode]).view(len(samples), width)

    loss_mask_BT = padded((s.loss_mask for s in samples), 0, "f")
    advantages_BT = None
    if token_advantages is not None:
        if [len(a) for a in token_advantages] != [len(s.tokens) for s in samples]:
            raise ValueError("token_advantages must hold one value per token of each sample")
        advantages_BT = padded(token_advantages, 0.0, "f")
        advantages = [((advantages_BT * loss_mask_BT).sum(1) / loss_mask_BT.sum(1).clamp_min(1.0)).tolist()]
    return RolloutBatch(
        tokens_BT=padded((s.tokens for s in samples), pad_id, "q"),
        attention_mask_BT=padded(([1] * len(s.tokens) for s in samples), 0, "q"),
        loss_mask_BT=loss_mask_BT,
        # The checks saw finite logprobs on trained tokens only; elsewhere they are 0.0 by contract.
        sampler_logprobs_BT=padded((s.logprobs for s in samples), 0.0, "f").nan_to_num(0.0, 0.0, 0.0) * loss_mask_BT,
        advantages_B=torch.tensor([a for adv in advantages for a in adv], dtype=torch.float32),
        rewards_B=torch.tensor([float(s.reward) for s in samples], dtype=torch.float64),  # float32 overflows at 3.4e38
        versions_B=torch.tensor([g.version for g in groups for _ in g.samples], dtype=torch.long),
        advantages_BT=advantages_BT,
        multi_modal=MultiModalBatch.of([s.multi_modal for s in samples]),
    )


def make_batch(
    accepted: list[PromptGroup],
    sampled: list[PromptGroup],
    *,
    version: int,
    pad_id: int,
    counts: Counter,
    timings: dict[str, float],
    advantage: Optional[Advantage] = None,
    mask_truncated: bool = False,
) -> RolloutBatch:
    """The step's batch of `accepted` groups, with its `RolloutRecord` (over every `sampled` group)
    attached. `version` is the trainer's policy version now. Needs at least one accepted group.
    `advantage` (`advantage=<name>`, `lit_grpo.advantages.registry`; None: grpo) computes each group's
    advantages: one per run, shared by its segments (a per-batch estimator sees all of `accepted`:
    this rank's groups), or (a per-token estimator such as igpo) one per token in `advantages_BT`.
    `mask_truncated` (`rollout.mask_truncated`) then zeroes the loss mask of the sequences that hit
    the length limit: advantages come first, so they still count in their group's statistics (as
    TRL's `mask_truncated_completions`), only their own gradient is dropped."""
    advantage = advantage or make_advantage("grpo")
    if advantage.per_token:
        token_advantages = [a for g in accepted for a in advantage.token_advantages(g.runs)]
        batch = collate_groups(accepted, [], pad_id, token_advantages)
    else:
        # One call for the step's groups: a per-batch estimator (batch_std, reinforce_pp) needs them all.
        per_group = advantage.batch_advantages([advantage.rewards_of(g.runs) for g in accepted])
        batch = collate_groups(accepted, [g.per_sample(a) for g, a in zip(accepted, per_group)], pad_id)
    masked = truncated_rows(s for g in accepted for s in g.samples) if mask_truncated else []
    if masked:
        batch.loss_mask_BT[masked] = 0.0
        batch.sampler_logprobs_BT[masked] = 0.0  # 0.0 off the trained tokens, as collate_groups leaves them
    batch.record = RolloutRecord(
        rewards=[r for g in sampled for r in g.rewards],
        completion_tokens=[sum(sum(s.loss_mask) for s in run) for g in sampled for run in g.runs],
        counts=Counter(counts),
        version_offsets=[version - g.version for g in accepted],
        timings=dict(timings),
        sample_metrics={
            **sample_metric_values(s for g in sampled for s in g.samples),
            **turn_metric_values(run for g in sampled for run in g.runs),
        },
        zero_spread=[rewards_uniform(g.rewards) for g in sampled if len(g.rewards) >= 2],
        finish_reasons=[str(s.finish_reason) for g in accepted for s in g.samples],
        trained_tokens=[sum(s.loss_mask) for g in accepted for s in g.samples],
        truncated_masked=len(masked) if mask_truncated else None,
        sampled_shapes=[sampled_shape(g) for g in sampled],
    )
    return batch


def sampled_shape(group: PromptGroup) -> tuple[int, list[tuple[int, int]]]:
    """What the sampler computed for `group` (`RolloutRecord.sampled_shapes`): the prompt its samples
    share, in tokens (0: their prompts differ), and each sample's (tokens, generated tokens). A
    sample's prompt is its tokens before the first one trained on."""
    prompts = [s.loss_mask.index(1) if 1 in s.loss_mask else len(s.tokens) for s in group.samples]
    first = group.samples[0].tokens[: prompts[0]] if group.samples else []
    shared = bool(prompts) and all(p == prompts[0] and s.tokens[:p] == first for p, s in zip(prompts, group.samples))
    return (prompts[0] if shared else 0), [(len(s.tokens), int(sum(s.loss_mask))) for s in group.samples]


def sample_metric_values(samples: Iterable[RolloutSample]) -> dict[str, list[float]]:
    """Per key of the samples' `metrics`, the finite values reported (a None or NaN is not applicable)."""
    values: dict[str, list[float]] = {}
    for s in samples:
        for key, value in s.metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return values


def reward_stats(rewards: list[float]) -> tuple[float, float]:
    """Mean and unbiased std of finite float64 rewards, finite whenever the values are (1e200
    included): the sum is taken of r / n, and the squares of deviations scaled by the largest."""
    n = len(rewards)
    if n == 0:
        return 0.0, 0.0
    mean = math.fsum(r / n for r in rewards)
    scale = max(abs(r - mean) for r in rewards)
    if n == 1 or scale == 0.0:
        return mean, 0.0
    return mean, scale * math.sqrt(math.fsum(((r - mean) / scale) ** 2 for r in rewards) / (n - 1))


def rollout_metrics(records: list[RolloutRecord]) -> dict[str, float]:
    """The rollout metrics of one step over every rank's record (a list of one without DDP).

    Rewards and lengths are pooled over all ranks' samples; counts add up; perf timings are the
    slowest rank's; `rollout/groups_accepted` is the groups trained on by all ranks together;
    `rollout/zero_spread_frac`, `rollout/truncated_frac` and `rollout/length_<reason>` are
    `lit_grpo.maths.health.rollout_health` of the pooled lists.
    """
    rewards = [float(r) for rec in records for r in rec.rewards]
    lengths = [n for rec in records for n in rec.completion_tokens]
    offsets = [o for rec in records for o in rec.version_offsets]
    mean, std = reward_stats(rewards)
    metrics = {
        "reward/mean": mean,
        "reward/std": std,
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
    for key in sorted({k for rec in records for k in rec.sample_metrics}):  # pooled over ranks, like the rewards
        pooled = [v for rec in records for v in rec.sample_metrics.get(key, [])]
        metrics[key] = math.fsum(pooled) / len(pooled)
    for key in {k for rec in records for k in rec.timings}:  # the step waits for the slowest rank
        metrics[key] = max(rec.timings[key] for rec in records if key in rec.timings)
    metrics.update(
        rollout_health(
            [z for rec in records for z in rec.zero_spread],
            [r for rec in records for r in rec.finish_reasons],
            [n for rec in records for n in rec.trained_tokens],
        )
    )
    if any(rec.truncated_masked is not None for rec in records):  # rollout.mask_truncated is on
        trained = sum(len(rec.finish_reasons) for rec in records)
        masked = sum(rec.truncated_masked or 0 for rec in records)
        metrics["rollout/truncated_masked_frac"] = masked / max(trained, 1)
    sample_s = metrics.get("perf/sample_s", 0.0)
    metrics["perf/sample_tokens_per_s"] = sum(lengths) / max(sample_s, 1e-9)
    return metrics
