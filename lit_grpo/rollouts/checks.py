"""Guards between a user's rollout function and the trainer: malformed samples, failing rollouts,
and a search for usable groups that finds none.

- A malformed `RolloutSample` is dropped with a named reason (counted as `rollout/dropped_<reason>`)
  instead of corrupting a batch (`sample_problem`).
- A rollout function that keeps raising on whole rows trips the circuit breaker (`CircuitBreaker`), which stops
  training with a clear error rather than training on whatever trickles through.
- Rows that never give an accepted group (every sample None or malformed, every group uniform,
  every prompt too long) stop the run after `guards.max_rows_without_progress` rows (`ProgressGuard`),
  with the counts per reason and what to check (`NoProgressError`).
- Groups that keep coming back uniform (every completion one reward: no advantage to learn from)
  are said to be so, in one warning with the reward and what to change, within `UNIFORM_NOTICE_S`
  of wall time (`UniformGroupWatch`), long before that stop.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Optional

from lit_grpo.advantages.registry import UNIFORM_TOLERANCE, rewards_uniform
from lit_grpo.errors import ServerLost, ServerUnreachable, UserError
from lit_grpo.types import RolloutSample

LOGPROB_TOLERANCE = 1e-4
"""A sampler's logprob may exceed 0 by this much (rounding); more is not a log-probability."""

# reason -> (what happened, what to check when it is why no group was accepted)
DROP_REASONS: dict[str, tuple[str, str]] = {
    "none": (
        "the rollout returned None",
        "the rollout function returns None for every sample: check when it gives up (an empty completion, "
        "a reward it could not compute, a parse failure)",
    ),
    "not_a_sample": (
        "not a RolloutSample",
        "a rollout function must return lit_grpo.types.RolloutSample(tokens, logprobs, loss_mask, reward), "
        "a RolloutRun(segments=[RolloutSample, ...]) or None",
    ),
    "empty_run": ("a RolloutRun with no segments", "RolloutRun.segments is a non-empty list of RolloutSample"),
    "segment_rewards_differ": (
        "the segments of one RolloutRun carry different rewards",
        "a run has one trajectory-level reward: put the same reward on every segment",
    ),
    "not_a_list": (
        "tokens, logprobs or loss_mask is not a list",
        "RolloutSample.tokens, .logprobs and .loss_mask are lists with one entry per token",
    ),
    "length_mismatch": (
        "tokens, logprobs and loss_mask differ in length",
        "tokens, logprobs and loss_mask are parallel lists: one entry per token, 0.0 logprob and "
        "mask 0 on tokens that were not generated (lit_grpo.rollouts.rollout.Trajectory builds them)",
    ),
    "bad_mask": (
        "loss_mask holds values other than 0 and 1",
        "loss_mask is 1 on tokens the policy generated and is trained on, 0 elsewhere",
    ),
    "empty_mask": ("loss_mask trains on no token", "at least one token of a sample must have loss_mask 1"),
    "bad_token": (
        "token ids that are not ints in [0, vocab)",
        "token ids must come from the policy's tokenizer (ints in [0, len(tokenizer)))",
    ),
    "bad_logprob": (
        "sampler logprobs that are not numbers, positive or non-finite on trained tokens",
        "logprobs are the sampler's log-probabilities of the generated tokens (finite, <= 0): take "
        "them from the Completion (sampling_logprobs), 0.0 on tokens that were not generated",
    ),
    "nonnumeric_reward": (
        "a reward that is not a number",
        "the reward must be a float (not a string, None or a bool): check the reward function",
    ),
    "nonfinite_reward": ("a NaN or infinite reward", "the reward must be finite: check the reward function"),
    "bad_metrics": ("metrics is not a dict", "RolloutSample.metrics maps a metric name to a float (or is left empty)"),
    "bad_turns": (
        "turn_spans or turn_rewards malformed",
        "turn_spans are in-order, non-overlapping [start, end) ranges into tokens, one per assistant "
        "turn, and turn_rewards holds one finite number per span (both None when turns are not reported)",
    ),
    "too_long": (
        "prompt + completion longer than data.max_seq_len",
        "samples are longer than data.max_seq_len: raise it, or lower sampler.max_completion_tokens",
    ),
    "prompt_too_long": (
        "the prompt alone fills data.max_seq_len (never sampled)",
        "the prompts are at least data.max_seq_len tokens long: raise data.max_seq_len or drop the long rows",
    ),
}
GROUP_REASONS: dict[str, tuple[str, str]] = {
    "failures": (
        "the rollout function raised",
        "the rollout function keeps raising: see the warning that names its error",
    ),
    "filtered_groups": (
        "a group filter rejected the group (the uniform-reward filter: all G rewards equal)",
        "every group's rewards are all equal, so no group carries a learning signal: a "
        "near-zero sampler.temperature makes the G samples identical; a task too hard "
        "(all 0) or too easy (all 1) does the same. Raise the temperature, change the "
        "task, or drop the filter (~callbacks.reward_filter) to train on them anyway",
    ),
    "small_group": (
        "fewer than data.min_group_size samples were left",
        "too few samples of each row came back: see the drop reasons above",
    ),
}

REASONS = {**DROP_REASONS, **GROUP_REASONS}


def short_reason(metric_key: str) -> str:
    """`rollout/dropped_none` -> `none`, `rollout/failures` -> `failures`: a key of REASONS."""
    return metric_key.removeprefix("rollout/").removeprefix("dropped_")


# The types a sampler's lists hold: checked by type first, which is ~10x cheaper than the ABCs
# below (the checks run on every sample); anything else (numpy scalars, ...) takes the slow path.
_INT = frozenset({int})
_REAL = frozenset({int, float})
_MASK = frozenset({int, float, bool})


def _types_within(values: list, types: frozenset) -> bool:
    return set(map(type, values)) <= types


def _all_zero_or_one(mask: list) -> bool:
    """Every value is 0 or 1 (False, True, 0.0 and 1.0 too: they hash and compare equal)."""
    if _types_within(mask, _MASK):
        return set(mask) <= {0, 1}
    try:
        return set(mask) <= {0, 1} and all(isinstance(m, numbers.Real) for m in set(mask))
    except TypeError:  # an unhashable value
        return False


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return type(x) in _REAL or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def shown_type(value: object) -> str:
    """`a dict with keys ['reward', 'tokens']`, `a tuple ([1, 2], ...)`: what a rollout returned, briefly."""
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:6]}"
    return f"a {type(value).__name__} {reprlib.repr(value)}"


def check_sample(sample: object, max_seq_len: int, vocab_size: Optional[int] = None) -> Optional[tuple[str, str]]:
    """`(reason, detail)` when `sample` cannot be trained on, else None. `reason` is a key of
    DROP_REASONS; `detail` shows what was wrong, for the warning."""
    if not isinstance(sample, RolloutSample):
        return "not_a_sample", f"got {shown_type(sample)}"
    lists = {"tokens": sample.tokens, "logprobs": sample.logprobs, "loss_mask": sample.loss_mask}
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            return "not_a_list", f"{name} is a {type(value).__name__}"
    tokens, logprobs, mask = sample.tokens, sample.logprobs, sample.loss_mask
    if not len(tokens) == len(logprobs) == len(mask):
        return "length_mismatch", f"{len(tokens)} tokens, {len(logprobs)} logprobs, {len(mask)} mask values"
    versions = sample.token_versions
    if versions is not None and (not isinstance(versions, list) or len(versions) != len(tokens)):
        return "length_mismatch", f"{len(tokens)} tokens; token_versions is not a list of as many versions"
    if not _all_zero_or_one(mask):
        odd_mask = [m for m in mask if not (isinstance(m, numbers.Real) and m in (0, 1))]  # True/False are fine
        return "bad_mask", f"loss_mask values {sorted(set(map(repr, odd_mask)))[:4]}"
    if not any(mask):
        return "empty_mask", f"{len(mask)} tokens, none with loss_mask 1"
    odd_tokens = [] if _types_within(tokens, _INT) else [t for t in tokens if not _is_int(t)]
    if odd_tokens:
        return "bad_token", f"token ids {[repr(t) for t in odd_tokens[:4]]} are not ints"
    if tokens and (min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size)):
        return "bad_token", f"token ids from {min(tokens)} to {max(tokens)}, the vocabulary is [0, {vocab_size})"
    if not _types_within(logprobs, _REAL) and not all(_is_real(lp) for lp in logprobs):
        return "bad_logprob", f"logprobs {[repr(lp) for lp in logprobs if not _is_real(lp)][:4]} are not numbers"
    trained = [float(lp) for lp, m in zip(logprobs, mask) if m]
    odd_lp = [lp for lp in trained if not math.isfinite(lp) or lp > LOGPROB_TOLERANCE]
    if odd_lp:
        return "bad_logprob", f"logprobs {odd_lp[:4]} on trained tokens (a logprob is finite and <= 0)"
    if not _is_real(sample.reward):
        return "nonnumeric_reward", f"reward {sample.reward!r} ({type(sample.reward).__name__})"
    if not math.isfinite(sample.reward):
        return "nonfinite_reward", f"reward {sample.reward!r}"
    if not isinstance(sample.metrics, dict):
        return "bad_metrics", f"metrics is a {type(sample.metrics).__name__}"
    turns = _turn_problem(sample)
    if turns is not None:
        return "bad_turns", turns
    if len(tokens) > max_seq_len:
        return "too_long", f"{len(tokens)} tokens > data.max_seq_len={max_seq_len}"
    return None


def _turn_problem(sample: RolloutSample) -> Optional[str]:
    """What is wrong with a sample's turns (`turn_spans`, `turn_rewards`), or None."""
    spans, rewards = sample.turn_spans, sample.turn_rewards
    if spans is None and rewards is None:
        return None
    if spans is None or rewards is None or len(spans) != len(rewards):
        return (
            f"{'no' if spans is None else len(spans)} turn_spans for "
            f"{'no' if rewards is None else len(rewards)} turn_rewards"
        )
    end = 0
    for span in spans:
        if not (
            isinstance(span, (list, tuple))
            and len(span) == 2
            and all(_is_int(i) for i in span)
            and end <= span[0] <= span[1] <= len(sample.tokens)
        ):
            return f"turn span {span!r} (after {end}, within {len(sample.tokens)} tokens)"
        end = span[1]
    if not all(_is_real(r) and math.isfinite(r) for r in rewards):
        return f"turn_rewards {list(rewards)[:4]}"
    return None


def sample_problem(sample: object, max_seq_len: int, vocab_size: Optional[int] = None) -> Optional[str]:
    """Why `sample` cannot be trained on (a key of DROP_REASONS), or None when it is fine."""
    problem = check_sample(sample, max_seq_len, vocab_size)
    return None if problem is None else problem[0]


class RolloutCircuitOpen(UserError, RuntimeError):
    """The rollout function failed too often; training stops instead of limping on."""


class CircuitBreaker:
    """Counts rows, not calls: a row fails when every rollout call of it raised. Trips after
    `max_consecutive` failed rows in a row, or when at least `max_failure_rate` of the last
    `window` rows failed (once `window` rows have been seen); a failed row alone only drops its
    group."""

    def __init__(self, max_consecutive: int = 5, window: int = 20, max_failure_rate: float = 0.5) -> None:
        self.max_consecutive, self.max_failure_rate = max_consecutive, max_failure_rate
        self.recent: deque[bool] = deque(maxlen=window)
        self.consecutive = 0

    def record(self, failed: bool, error: Optional[BaseException] = None) -> None:
        """Count one row; raise `RolloutCircuitOpen` when the breaker trips."""
        self.recent.append(failed)
        self.consecutive = self.consecutive + 1 if failed else 0
        rate = sum(self.recent) / len(self.recent)
        if self.consecutive >= self.max_consecutive or (
            len(self.recent) == self.recent.maxlen and rate >= self.max_failure_rate
        ):
            counts = (
                f"on {self.consecutive} rows in a row and on {sum(self.recent)} of the last {len(self.recent)} rows"
            )
            server = server_unreachable(error)
            if server is not None:  # not the rollout function's fault: name the server and how to continue
                raise ServerLost(f"{server} ({counts})", remedy=server.remedy) from error
            hint = (
                "raise guards.rollout_timeout_s if the rollouts are slow but sound"
                if isinstance(error, TimeoutError)
                else "fix the rollout function (or its environment) and resume"
            )
            raise RolloutCircuitOpen(
                f"rollout_fn failed {counts} (every call of a failed row raised); last error: {error!r}. "
                f"Training stops: {hint} (the limits: guards.rollout_failure_share, guards.rollout_failure_window)."
            ) from error


def server_unreachable(error: Optional[BaseException]) -> Optional[ServerUnreachable]:
    """The `ServerUnreachable` behind `error` (itself, or what it was raised from), or None."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, ServerUnreachable):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


UNIFORM_NOTICE_S = 60.0
"""The wall time over which the share of uniform groups is judged, and after which it is said once."""
UNIFORM_NOTICE_SHARE = 0.8
"""The share of uniform groups in such a period that is worth a warning."""
UNIFORM_NOTICE_MIN_GROUPS = 4
"""Fewer groups in a period say too little to warn on."""


class UniformGroupWatch:
    """Counts, over periods of `period_s` wall seconds, the groups whose runs all got one reward;
    the first period in which at least `share` of `min_groups` or more groups were uniform gets one
    warning line (`record` returns it): the rewards they had, the share, and what to change. Said
    once a run: the no-progress stop, if it comes, says the rest."""

    def __init__(
        self,
        *,
        completions_per_prompt: int,
        stop_after_rows: int,
        period_s: float = UNIFORM_NOTICE_S,
        share: float = UNIFORM_NOTICE_SHARE,
        min_groups: int = UNIFORM_NOTICE_MIN_GROUPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.G, self.stop_after_rows = completions_per_prompt, stop_after_rows
        self.period_s, self.share, self.min_groups, self.clock = period_s, share, min_groups, clock
        self.said = False
        self._start: Optional[float] = None
        self._groups = 0
        self._uniform: Counter = Counter()  # reward value -> uniform groups with it

    def record(self, rewards: Sequence[float]) -> Optional[str]:
        """Count one judged group by its runs' rewards; the warning line when one is due, else None."""
        if self.said or not rewards:
            return None
        now = self.clock()
        if self._start is None:
            self._start = now
        self._groups += 1
        if rewards_uniform(rewards, UNIFORM_TOLERANCE):
            self._uniform[float(rewards[0])] += 1
        if now - self._start < self.period_s or self._groups < self.min_groups:
            return None
        uniform = sum(self._uniform.values())
        if uniform >= self.share * self._groups:
            self.said = True
            return self.notice(uniform, self._groups, now - self._start)
        self._start, self._groups, self._uniform = now, 0, Counter()  # a new period
        return None

    def notice(self, uniform: int, groups: int, seconds: float) -> str:
        by_value = ", ".join(f"{n} at {value:g}" for value, n in self._uniform.most_common(3))
        common = self._uniform.most_common(1)[0][0]
        why = (
            "the model rarely earns any reward on these rows"
            if common <= 0
            else f"most completions score {common:g} alike: the task may be too easy, or the reward too coarse"
        )
        advice = (
            "a shaping or format reward beside the task's (reward.fn=[<task reward>,my_rewards:format] "
            "reward.weights=[1.0,0.2]), an easier task, more completions per prompt "
            f"(data.completions_per_prompt={2 * self.G}), a higher sampler.temperature, or train on uniform "
            "groups anyway (~callbacks.reward_filter)"
        )
        return (
            f"{uniform} of the {groups} groups sampled in the last {seconds:.0f} s ({uniform / groups:.0%}) came back "
            f"uniform, all {self.G} completions with one reward ({by_value}): such a group has no advantage to learn "
            f"from (the uniform-reward filter, when on, drops it). {why[0].upper() + why[1:]}. Change one of: "
            f"{advice}. The run stops after {self.stop_after_rows} rows in a row without a group that trains "
            "(guards.max_rows_without_progress)."
        )


class NoProgressError(UserError, RuntimeError):
    """Rows keep being sampled and none gives a group that trains; the message says why."""


class ProgressGuard:
    """Counts the rows sampled since the last accepted group, and why each was rejected; raises
    `NoProgressError` when `max_rows` rows in a row gave nothing to train on."""

    def __init__(self, max_rows: int, *, max_seq_len: int) -> None:
        self.max_rows, self.max_seq_len = max_rows, max_seq_len
        self.rows = 0
        """Rows rejected since the last accepted group."""
        self.row_reasons: Counter = Counter()
        """Per rejected row, its main reason (a key of DROP_REASONS or GROUP_REASONS)."""
        self.sample_counts: Counter = Counter()
        """Metric counts (`rollout/dropped_<reason>`, `rollout/failures`, ...) of those rows."""
        self.examples: dict[str, str] = {}
        """reason -> the first detail seen (what a dropped sample looked like)."""

    def accepted(self) -> None:
        self.rows = 0
        self.row_reasons.clear()
        self.sample_counts.clear()

    def rejected(self, verdict: str, dropped: Counter) -> None:
        """One more row without an accepted group: `verdict` is the group's metric key, `dropped`
        the row's sample counts by metric key."""
        self.rows += 1
        self.sample_counts.update(dropped)
        main = verdict
        drops = Counter({key: n for key, n in dropped.items() if short_reason(key) in REASONS})
        if verdict == "rollout/dropped_small_group" and drops:
            main = drops.most_common(1)[0][0]
        self.row_reasons[short_reason(main)] += 1
        if self.rows >= self.max_rows:
            raise NoProgressError(
                self.message(f"the last {self.rows} rows sampled (guards.max_rows_without_progress={self.max_rows})")
            )

    def message(self, where: str) -> str:
        def describe(reason: str) -> str:
            return REASONS[reason][0] if reason in REASONS else reason

        lines = [f"no prompt group was accepted in {where}: training cannot make progress."]
        lines.append("Rows, by why their group was rejected:")
        lines += [f"  {n:6d}  {reason}: {describe(reason)}" for reason, n in self.row_reasons.most_common()]
        if self.sample_counts:
            lines.append("Samples of those rows, by metric:")
            lines += [f"  {n:6d}  {key}" for key, n in sorted(self.sample_counts.items(), key=lambda kv: -kv[1])]
        dominant = self.row_reasons.most_common(1)[0][0] if self.row_reasons else None
        if dominant is not None:
            hint = REASONS[dominant][1] if dominant in REASONS else "see the warnings above"
            example = self.examples.get(dominant)
            lines.append(f"Check: {hint}" + (f" (first seen: {example})" if example else "") + ".")
            if dominant in ("too_long", "prompt_too_long"):
                lines.append(f"data.max_seq_len is {self.max_seq_len}.")
        return "\n".join(lines)
