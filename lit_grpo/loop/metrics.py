"""A step's metrics: merged over ranks, kept in a history, handed to the loggers.

Every key is namespaced (docs/guides/metrics.md lists them all): `train/` (the loss and its own
metrics, lr, entropy, gradient norms, tokens, skipped steps, and the loss's sub-families such as
`train/drift/k1`, `train/correction/weight_mean`), `reward/` (mean, std, max over every sampled
group of every rank), `rollout/` (lengths, accepted groups, one count per drop reason,
`rollout/zero_spread_frac`, `rollout/truncated_frac`, `rollout/length_<finish reason>`), `async/`
(version offsets, rollouts in flight), `perf/` (seconds per phase, tokens per second,
`perf/padding_frac`, model FLOPs and their utilization: `lit_grpo.loop.mfu`), `policy/version` and
`eval/accuracy`. The health signals (`train/drift/*`, `train/tokens`, `train/grad_norm_clipped` and
the `rollout/` ones after the drop counts) are defined in `lit_grpo.maths.health`.
"""

from __future__ import annotations

import torch

from lit_grpo.loop.distributed import all_gather_objects, all_reduce
from lit_grpo.loop.mfu import merge_flops
from lit_grpo.rollouts.pipeline import rollout_metrics
from lit_grpo.types import RolloutRecord


class MetricHistory:
    """`steps[i]` holds the scalar metrics of rollout step i (what the loggers got)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def append(self, metrics: dict[str, float]) -> None:
        self.steps.append(metrics)

    def series(self, key: str) -> list[float]:
        return [s[key] for s in self.steps if key in s]

    def state_dict(self) -> dict:
        return {"steps": [dict(s) for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [dict(s) for s in state["steps"]]


def merge_step_metrics(
    record: RolloutRecord, train_metrics: dict[str, torch.Tensor], timings: dict[str, float]
) -> dict[str, float]:
    """One step's metrics over every rank (a collective: every rank calls it once per step).

    `train_metrics` are this rank's shares of the global values (summed over ranks); records are
    pooled by `rollout_metrics`; `perf/*_s` timings are the slowest rank's; `train_tokens` (real
    tokens) and `train_token_slots` (the token slots the forwards computed, padding included) add
    up, so `perf/padding_frac` is the padding of every rank's forwards together; so do the token
    rows a shared prefix saved the training forwards (`perf/prefix_tokens_saved`), the rows of
    advantage 0 they left out (`perf/rows_skipped`) and the step's
    FLOPs by phase (`perf/flops/*`, `lit_grpo.loop.mfu.merge_flops`).
    """
    gathered = all_gather_objects((record, timings))
    metrics = rollout_metrics([rec for rec, _ in gathered])
    keys = sorted(train_metrics)
    if keys:
        summed = all_reduce(torch.stack([train_metrics[k].float().reshape(()) for k in keys]))
        metrics.update(zip(keys, summed.tolist()))
    per_rank = [t for _, t in gathered]
    for key in {k for t in per_rank for k in t if k.startswith("perf/")}:
        metrics[key] = max(t[key] for t in per_rank if key in t)
    train_tokens = sum(t.get("train_tokens", 0.0) for t in per_rank)
    metrics["perf/train_tokens_per_s"] = train_tokens / max(metrics.get("perf/train_s", 0.0), 1e-9)
    token_slots = sum(t.get("train_token_slots", 0.0) for t in per_rank)
    if token_slots > 0:
        metrics["perf/padding_frac"] = 1.0 - train_tokens / token_slots
    metrics["perf/prefix_tokens_saved"] = sum(t.get("prefix_tokens_saved", 0.0) for t in per_rank)
    metrics["perf/rows_skipped"] = sum(t.get("rows_skipped", 0.0) for t in per_rank)
    metrics.update(merge_flops(per_rank))
    return metrics
