"""Rows to training batches: the row cursor, the pure pipeline, the group sampler and the two schedulers.

cursor.py      RowCursor: this rank's disjoint, seeded, resumable share of the rows
curriculum.py  CurriculumCursor: rows drawn by their online pass rate (`curriculum.kind` pools | fn)
pipeline.py    pure functions: checks, group verdicts, advantages and padding, rollout metrics
groups.py      GroupSampler: the G rollout calls of a row, the circuit breaker, drop counts
schedulers.py  the Scheduler interface and SynchronousScheduler
offpolicy.py   OffPolicyScheduler: the off-policy gate, sampling on a background loop
checks.py      what makes a sample malformed; the circuit breaker; the no-progress guard
deadlines.py   each rollout call's deadline and retries; a blocked event loop detected and named
waiting.py     a line a minute, while a step's groups are awaited, saying what they wait on
"""

from lit_grpo.rollouts.checks import NoProgressError, RolloutCircuitOpen
from lit_grpo.rollouts.cursor import RowCursor
from lit_grpo.rollouts.deadlines import RolloutStalled, RolloutTimeout
from lit_grpo.rollouts.groups import GroupSampler
from lit_grpo.rollouts.offpolicy import OffPolicyScheduler
from lit_grpo.rollouts.pipeline import GroupFilter, collate_groups, make_batch, rollout_metrics
from lit_grpo.rollouts.schedulers import Scheduler, StepGroups, SynchronousScheduler

__all__ = [
    "GroupFilter",
    "GroupSampler",
    "NoProgressError",
    "OffPolicyScheduler",
    "RolloutCircuitOpen",
    "RolloutStalled",
    "RolloutTimeout",
    "RowCursor",
    "Scheduler",
    "StepGroups",
    "SynchronousScheduler",
    "collate_groups",
    "make_batch",
    "rollout_metrics",
]
