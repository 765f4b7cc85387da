"""Evaluation every N steps and at the end, behind one protocol (`Evaluator`) the step sequence
runs in one loop, after the weight sync, so each scores the sampler holding the policy just trained:

- `GreedyEvaluator`: `eval/accuracy`, the mean reward of one greedy completion per held-out row
  (and `eval/reward/<name>`, each component's mean, with a weighted reward list).
  Under data parallelism each rank scores its share of the rows and the sums are reduced.
- `RolloutEvaluator`: the cookbook's hook, `evaluation_fn(step, eval_rollout_fn) -> dict | None`,
  awaited on rank 0 (the others go on to the next step's collectives and wait there), on an event
  loop of its own, under a deadline: past it, the evaluation is cancelled with a warning and
  training goes on; any other exception is a bug and stops the run, as a rollout bug does.
  `eval_rollout_fn` is the run's own rollout function called with `evaluation=True`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Optional, Protocol

import torch

from lit_grpo.loop.distributed import all_reduce
from lit_grpo.rewards.combine import part_key
from lit_grpo.rewards.scoring import RewardScorer, Scored
from lit_grpo.rollouts.context import make_evaluation_rollout_fn
from lit_grpo.rollouts.rollout import row_prompt

log = logging.getLogger(__name__)


class Evaluator(Protocol):
    """What the step sequence asks of an evaluation."""

    last_step: Optional[int]
    """The step of the latest evaluation (None before the first)."""
    last_metrics: dict[str, float]
    """The latest evaluation's metrics, for the run's summary."""

    def due(self, step: int) -> bool:
        """Whether to evaluate after step `step`."""

    def evaluate(self, step: int, rank: int, world_size: int) -> dict[str, float]:
        """The metrics of an evaluation after step `step` (called on every rank; may be a collective)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def greedy_scores(
    sampler,
    tokenizer,
    rows: list[dict],
    reward_fn,
    max_tokens: int,
    batch_size: int,
    prompt_field: Optional[str] = None,
    processor=None,
) -> list[Scored]:
    """The reward of one greedy completion per row, in order, with each component's value
    (`Scored.parts`) when the reward is a weighted list. Prompts are made as the default rollout
    makes them (`row_prompt`: with a vision-language policy's `processor`, a row's images go to
    the sampler too). `reward_fn`: a `RewardScorer` (async rewards, deadlines), or a plain reward
    function."""
    scorer = reward_fn if isinstance(reward_fn, RewardScorer) else RewardScorer(reward_fn)
    results: list[Scored] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [row_prompt(r, tokenizer, processor, prompt_field) for r in chunk]
        images = [p[1] for p in prompts]
        more = {"multi_modal": images} if any(images) else {}  # a text-only chunk calls generate as before
        completions = sampler.generate([p[0] for p in prompts], 0.0, max_tokens, **more)
        results += scorer.score_all_blocking([(c.text, row) for c, row in zip(completions, chunk)])
    return results


def greedy_reward_sum(*args: Any, **kwargs: Any) -> tuple[float, int]:
    """Sum of the rewards of `greedy_scores(*args, **kwargs)`, and how many rows were scored (a
    reward of None, not applicable to its row, counts in neither)."""
    values = [r.value for r in greedy_scores(*args, **kwargs) if r.value is not None]
    return float(sum(values)), len(values)


def component_means(results: list[Scored], names: list[str], rank_sums) -> dict[str, float]:
    """`eval/reward/<name>`: the mean of each reward component `names` over the rows it applied to,
    on all ranks (`rank_sums` reduces a float64 tensor of sums over the ranks)."""
    if not names:
        return {}
    keys = [part_key(name) for name in names]
    counts = [(sum(r.parts.get(key, 0.0) for r in results), sum(key in r.parts for r in results)) for key in keys]
    totals = rank_sums(torch.tensor(counts, dtype=torch.float64)).tolist()
    return {f"eval/reward/{name}": s / n if n else float("nan") for name, (s, n) in zip(names, totals)}


class GreedyEvaluator:
    """Scores the sampler on held-out rows with greedy decoding: `eval/accuracy`, every `interval` steps."""

    def __init__(
        self,
        sampler,
        tokenizer,
        rows: list[dict],
        reward_fn: Optional[RewardScorer | Callable[[str, dict], Optional[float]]],
        *,
        interval: int = 0,
        max_tokens: int = 256,
        batch_size: int = 64,
        prompt_field: Optional[str] = None,
        processor=None,
        at_start: bool = False,
    ) -> None:
        self.sampler, self.tokenizer, self.rows, self.reward_fn = sampler, tokenizer, rows, reward_fn
        self.processor = processor
        """A vision-language policy's processor: the rows' images go to the sampler (None: text)."""
        self.interval, self.max_tokens, self.batch_size, self.prompt_field = (
            interval,
            max_tokens,
            batch_size,
            prompt_field,
        )
        self.last_metrics: dict[str, float] = {}
        self.last_step: Optional[int] = None
        self.at_start = at_start and bool(rows)
        """Whether a fresh run scores the rows before its first step too (`eval_at_start`)."""
        self.start_metrics: dict[str, float] = {}
        """That first evaluation's metrics (kept through a resume, for the summary)."""
        weighted = reward_fn.weighted if isinstance(reward_fn, RewardScorer) else None
        self.component_names = [name for name, _ in weighted.components] if weighted else []
        """A weighted reward list's components, each logged as `eval/reward/<name>` beside `eval/accuracy`
        (the weighted sum): a format reward's share apart from correctness."""

    def due(self, step: int) -> bool:
        return bool(self.rows) and self.interval > 0 and step % self.interval == 0

    def evaluate_at_start(self, rank: int = 0, world_size: int = 1) -> dict[str, float]:
        """The evaluation before the first step (step 0), when `at_start`; else nothing."""
        if not self.at_start:
            return {}
        self.start_metrics = self.evaluate(0, rank, world_size)
        return dict(self.start_metrics)

    def evaluate(self, step: int, rank: int = 0, world_size: int = 1) -> dict[str, float]:
        """`eval/accuracy` over all ranks' shares of the rows (a collective); nothing without rows."""
        self.last_step = step
        if not self.rows:
            return {}
        start = time.perf_counter()
        share = self.rows[rank::world_size]
        results = (
            greedy_scores(
                self.sampler,
                self.tokenizer,
                share,
                self.reward_fn,
                self.max_tokens,
                self.batch_size,
                self.prompt_field,
                self.processor,
            )
            if share
            else []
        )
        values = [r.value for r in results if r.value is not None]
        total, scored = all_reduce(torch.tensor([sum(values), len(values)], dtype=torch.float64)).tolist()
        accuracy = total / scored if scored else float("nan")
        parts = component_means(results, self.component_names, all_reduce)
        self.last_metrics = {"eval/accuracy": accuracy, **parts}
        log.info(
            "step %d: eval/accuracy %.4f on %d held-out rows (%d scored; the reward applies to those)%s (%.1f s)",
            step,
            accuracy,
            len(self.rows),
            int(scored),
            "".join(f", {name} {value:.4f}" for name, value in parts.items()),
            time.perf_counter() - start,
        )
        return dict(self.last_metrics)

    def state_dict(self) -> dict:
        return {"last": dict(self.last_metrics), "last_step": self.last_step, "start": dict(self.start_metrics)}

    def load_state_dict(self, state: dict) -> None:
        self.last_metrics = {
            k: v for k, v in state["last"].items() if k == "eval/accuracy" or k.startswith("eval/reward/")
        }
        self.start_metrics = dict(state.get("start", {}))  # absent from checkpoints written before it was kept
        # Checkpoints written before `last_step` was saved kept the step in `last` as "eval/step".
        step = state.get("last_step", state["last"].get("eval/step"))
        self.last_step = None if step is None else int(step)


class RolloutEvaluator:
    """Awaits the user's `evaluation_fn` when due and turns its result into metrics."""

    def __init__(
        self,
        evaluation_fn: Callable[[int, Callable[..., Awaitable[Any]]], Awaitable[Optional[dict]]],
        rollout_fn: Callable[..., Awaitable[Any]],
        *,
        interval: int = 1,
        timeout_s: float = 3600.0,
    ) -> None:
        if interval < 1:
            raise ValueError(f"evaluation_interval must be >= 1, got {interval}")
        self.evaluation_fn, self.interval, self.timeout_s = evaluation_fn, interval, timeout_s
        self.eval_rollout_fn = make_evaluation_rollout_fn(rollout_fn)
        self.last_step: Optional[int] = None
        self.last_metrics: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and step != self.last_step

    def evaluate(self, step: int, rank: int = 0, world_size: int = 1) -> dict[str, float]:
        """The metrics of `evaluation_fn(step, eval_rollout_fn)` (rank 0; other ranks get none)."""
        self.last_step = step
        if rank != 0:
            return {}
        start = time.perf_counter()
        try:
            result = asyncio.run(asyncio.wait_for(self.evaluation_fn(step, self.eval_rollout_fn), self.timeout_s))
        except TimeoutError:
            log.warning(
                "step %d: evaluation_fn did not return within %g s; it was cancelled and training goes on",
                step,
                self.timeout_s,
            )
            return {"eval/timeouts": 1.0}
        if result is not None and not isinstance(result, Mapping):
            raise TypeError(
                f"evaluation_fn returned a {type(result).__name__}; it must return a dict of metrics or None"
            )
        metrics = {"eval/wall_time": time.perf_counter() - start}
        for key, value in (result or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                metrics[str(key)] = float(value)
            else:
                log.warning("step %d: evaluation_fn returned %s=%r, not a finite number; not logged", step, key, value)
        self.last_metrics = metrics
        return metrics

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = state.get("last_step")
