"""Model FLOPs utilization: each phase's model FLOPs (`lit_grpo.maths.flops`) over its time and the
machine's peak (`lit_grpo.run.peak`), logged every step.

    phase    FLOPs (summed over ranks)                       time
    sample   the sampler's prefill and decode of every       perf/sample_s
             group sampled for the step, filtered ones too
    ref      the reference's forward (when there is one)     perf/ref_s
    train    the policy's forwards and backwards, and the    perf/train_s
             `old` forward when one runs (it is timed there)

`perf/flops/*` are the FLOPs; `perf/mfu/*` = FLOPs / (its time × peak × ranks); `perf/mfu`
= all of them / (`perf/step_s` × peak × ranks), the step's wall time. In asynchronous training the
sampler's window overlaps the trainer's, so the phases' MFUs may add up to more than `perf/mfu`,
which is the machine's share used over the step. The peak is one process's (a CPU's at its thread
count, a card's), times the ranks.

Counted as the step computed them: a prefix that rows share (`batching.share_prefixes`) once in
the trainer's forwards, as a group's prompt in the sampler's; the trainer's LM head over the
positions from each sequence's first trained token (the fused head's), or over every token where
the head runs whole (an unfused, packed forward). Padding, recomputation and rollouts that
returned nothing are not counted. The `old` forward, timed inside `perf/train_s`, is counted in
`train`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from lit_grpo.maths.flops import ModelShape, Span, backward_flops, forward_flops, model_shape, sampling_flops
from lit_grpo.maths.head_logprobs import split_lm_head
from lit_grpo.maths.logprobs import keeps_logits
from lit_grpo.types import RolloutBatch

log = logging.getLogger(__name__)

FLOP_METRICS = {"sample_flops": "perf/flops/sample", "ref_flops": "perf/flops/ref", "train_flops": "perf/flops/train"}
"""A rank's step FLOPs (its `StepResult.timings` keys) and the metric of their sum over ranks."""
MFU_METRICS = (
    ("perf/flops/sample", "perf/sample_s", "perf/mfu/sample"),
    ("perf/flops/ref", "perf/ref_s", "perf/mfu/ref"),
    ("perf/flops/train", "perf/train_s", "perf/mfu/train"),
)
"""(FLOPs, seconds, utilization) of each phase."""


def policy_shape(policy: Any) -> Optional[ModelShape]:
    """The `ModelShape` of a policy (through a peft wrapper), or None: a model whose FLOPs are not
    counted (one debug line says why; `perf/flops/*` and `perf/mfu*` are then not logged)."""
    get_base = getattr(policy, "get_base_model", None)
    config = getattr(get_base() if get_base is not None else policy, "config", None)
    shape, why_not = model_shape(config) if config is not None else (None, "it has no transformers config")
    if shape is None:
        log.debug("perf/mfu not logged: %s", why_not)
    return shape


def head_on_scored_only(model: Any, fused_head: bool, packed: bool) -> bool:
    """Whether `token_logprobs` runs `model`'s LM head over the scored predictions only (the fused
    head, or transformers' `logits_to_keep` on padded rows), not over every token (an unfused,
    packed forward). `packed`: padding-free micro-batches are on; the few a step leaves padded
    where packing does not pay differ only without the fused head, and are counted as packed."""
    if fused_head and split_lm_head(model)[0] is not None:
        return True
    return not packed and keeps_logits(model)


def step_flops(
    shape: ModelShape,
    batch: RolloutBatch,
    policy_head_scored: bool,
    reference_head_scored: Optional[bool],
    old_forward: bool,
    frozen_weights: bool,
    train_spans: Optional[list[Span]] = None,
    no_grad_spans: Optional[list[Span]] = None,
    trained: Optional[list[bool]] = None,
) -> dict[str, float]:
    """One rank's model FLOPs of a step, by phase (`FLOP_METRICS`' keys), from the host-side groups
    and record of `batch`: the sampler's over `record.sampled_shapes`; the trainer's over the
    positions its forwards computed (`train_spans`, `no_grad_spans` for the reference's and `old`'s:
    a shared prefix once; None: each trained sequence whole), its LM head over the predictions from
    each sequence's first trained token (`*_head_scored`) or over all its tokens;
    `reference_head_scored` None: no reference; `frozen_weights`: LoRA; `trained`: the rows the
    trainer's forwards computed (one flag per row, as `batch`'s; None: all).
    {} when the batch has no host-side groups (a batch made by hand)."""
    sampled = [s for g in batch.groups for s in g.samples]
    if not sampled:
        return {}
    samples = sampled if trained is None else [s for s, kept in zip(sampled, trained) if kept]
    lengths = [len(s.tokens) for s in samples]
    scored = [len(s.tokens) - (s.loss_mask.index(1) if 1 in s.loss_mask else len(s.tokens)) for s in samples]

    def heads(scored_only: bool) -> int:
        return sum(scored) if scored_only else sum(lengths)

    whole = [(0, n) for n in lengths]
    train, no_grad = train_spans or whole, no_grad_spans or whole
    forward = forward_flops(shape, train, heads(policy_head_scored))
    backward = backward_flops(shape, train, heads(policy_head_scored), frozen_weights)
    old = forward_flops(shape, no_grad, heads(policy_head_scored)) if old_forward else 0
    flops = {
        "sample_flops": float(sampling_flops(shape, batch.record.sampled_shapes)),
        "train_flops": float(forward + backward + old),
    }
    if reference_head_scored is not None:
        flops["ref_flops"] = float(forward_flops(shape, no_grad, heads(reference_head_scored)))
    return flops


def merge_flops(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """`perf/flops/*`: every rank's FLOPs of the phase added up (absent when no rank counted it)."""
    return {
        metric: sum(t[key] for t in per_rank if key in t)
        for key, metric in FLOP_METRICS.items()
        if any(key in t for t in per_rank)
    }


def mfu_metrics(metrics: dict[str, float], peak_flops_per_s: float, world_size: int) -> dict[str, float]:
    """`perf/mfu/*` of each phase with FLOPs and a time, and `perf/mfu` over `perf/step_s`,
    from a step's merged metrics and one process's peak FLOP/s."""
    peak = peak_flops_per_s * max(world_size, 1)
    out = {}
    for flops_key, seconds_key, mfu_key in MFU_METRICS:
        flops, seconds = metrics.get(flops_key, 0.0), metrics.get(seconds_key, 0.0)
        if flops > 0 and seconds > 0:
            out[mfu_key] = flops / (seconds * peak)
    total = sum(metrics.get(flops_key, 0.0) for flops_key, _, _ in MFU_METRICS)
    if total > 0 and metrics.get("perf/step_s", 0.0) > 0:
        out["perf/mfu"] = total / (metrics["perf/step_s"] * peak)
    return out
