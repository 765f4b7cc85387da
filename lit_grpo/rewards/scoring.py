"""Scoring completions with the run's reward without ever blocking the rollouts or waiting forever.

A reward component may be a plain function or an `async def` (an LLM judge, a sandboxed code
runner, a reward server). `RewardScorer.score` runs a completion's components concurrently:

- an `async def` component is awaited on the rollouts' event loop; a plain one marked
  `inline_reward` (every built-in: cheap and pure) is called right there; any other plain one runs on a daemon
  thread of its own, so a slow one (a regex over a long text, a subprocess) does not stall the
  loop, and one that never returns cannot keep the process from exiting;
- at most `max_concurrency` components run at once in one event loop (a semaphore): a judge
  server sees a bounded number of requests whatever the rollout concurrency;
- each component has `timeout_s` (the wait for a slot included): past it, the component's value is
  `timeout_reward` and the sample's `reward/timed_out` metric is 1 (logged as the step's mean). A
  plain function past its deadline keeps its thread until it returns (Python cannot stop a
  thread), outside the limit: prefer `async def` for anything that may hang.

A substituted reward trains like a real one, so it is never silent: the first is logged (naming
`reward.timeout_s`, the value put in its place and the reward function), the scorer counts them
(`samples`, `timed_out`: the run logs the total at its end), and once more than
`max_timeout_share` of the last `TIMEOUT_WINDOW` samples were substitutes, scoring raises
`RewardTimeouts`: the reward is down or far too slow, and the run stops (its last finished step
kept) rather than train on stand-ins.

An exception from a component is not swallowed: it is a bug in the reward, and the rollout that
called it fails (then the run stops with its message). A lone reward's value goes on as it came
(a non-number or NaN drops its sample in the rollout checks, counted); a weighted component's must
be a number or None.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Optional, Union, cast

from lit_grpo.errors import EnvironmentFault
from lit_grpo.rewards.combine import WeightedReward
from lit_grpo.rewards.registry import INLINE_ATTRIBUTE

log = logging.getLogger(__name__)

SyncOrAsyncReward = Callable[[str, dict], Union[Optional[float], Awaitable[Optional[float]]]]

TIMED_OUT_METRIC = "reward/timed_out"
"""Each sample's 1.0 (a component hit its deadline) or 0.0; the step logs the mean."""
TIMEOUT_WINDOW = 64
"""The last samples scored whose share of substituted rewards `max_timeout_share` bounds."""


class RewardTimeouts(EnvironmentFault):
    """Most recent samples scored `timeout_reward` in place of their reward: the reward (a judge, a
    reward server) is down or too slow. The run stops, keeping its last finished step."""

    remedy = (
        "Bring the reward back (its server, its load), raise reward.timeout_s or reward.max_concurrency, or set "
        "reward.max_timeout_share=1.0 to train on the substitutes anyway,"
    )
    """What to do, for the step sequence's message on where `resume=auto` continues."""


def reward_label(fn: object) -> str:
    """`module.qualname` of a reward function (the type's name for a callable object)."""
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{getattr(target, '__module__', None) or type(target).__module__}.{name}"


def is_async_reward(fn: object) -> bool:
    """Whether calling `fn` returns an awaitable (an `async def`, or an object whose `__call__` is one)."""
    call = type(fn).__call__ if callable(fn) and not inspect.isfunction(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


@dataclass
class Scored:
    """A completion's reward (None: not applicable to its row), its per-component metrics, and
    whether any component timed out (its value was the fallback)."""

    value: Optional[float]
    parts: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False

    @property
    def metrics(self) -> dict[str, float]:
        return {**self.parts, TIMED_OUT_METRIC: float(self.timed_out)}


async def in_daemon_thread(fn: Callable, *args):
    """`fn(*args)` on a thread of its own, awaited. A daemon thread, not the loop's executor: a
    reward that never returns must neither hold up the loop's shutdown nor the process's exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():  # the awaiting side may have given up (its deadline)
            outcome()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as err:  # handed to the awaiting side, which raises it
            report = functools.partial(settle, functools.partial(done.set_exception, err))
        else:
            report = functools.partial(settle, functools.partial(done.set_result, result))
        try:
            loop.call_soon_threadsafe(report)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await done


class RewardScorer:
    """The run's reward (`lit_grpo.rewards.combine`: one function or a `WeightedReward`), scored
    under a concurrency limit and a deadline per component."""

    def __init__(
        self,
        reward_fn: SyncOrAsyncReward,
        *,
        max_concurrency: int = 64,
        timeout_s: float = 60.0,
        timeout_reward: float = 0.0,
        max_timeout_share: float = 0.5,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 0 < max_timeout_share <= 1:
            raise ValueError(f"max_timeout_share must be in (0, 1], got {max_timeout_share}")
        self.reward_fn = reward_fn
        self.max_concurrency, self.timeout_s, self.timeout_reward = max_concurrency, timeout_s, float(timeout_reward)
        self.max_timeout_share = max_timeout_share
        """Past this share of substitutes among the last `TIMEOUT_WINDOW` samples, scoring raises (1.0: never)."""
        self.samples = 0
        """Samples scored (with a value or None) since the scorer was made."""
        self.timed_out = 0
        """Of those, the ones one of whose components scored `timeout_reward` in place of its value."""
        self._recent: deque[bool] = deque(maxlen=TIMEOUT_WINDOW)
        self.weighted: Optional[WeightedReward] = reward_fn if isinstance(reward_fn, WeightedReward) else None
        self.components: list[tuple[str, SyncOrAsyncReward]] = [("reward", reward_fn)]
        self.weights = [1.0]
        if self.weighted is not None:
            self.components, self.weights = list(self.weighted.components), self.weighted.weights
        # One semaphore per event loop (the rollouts' loop, an evaluation's `asyncio.run`): an
        # asyncio primitive belongs to the loop it was first used in.
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._limits:
            self._limits[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._limits[loop]

    async def _component(self, fn: SyncOrAsyncReward, text: str, row: dict) -> tuple[object, bool]:
        """The component's value as it came (or the fallback), and whether it timed out."""
        if getattr(fn, INLINE_ATTRIBUTE, False):  # cheap and pure (`inline_reward`): no thread, no deadline
            return fn(text, row), False

        async def call() -> object:
            async with self._limit():
                if is_async_reward(fn):
                    return await cast(Awaitable[object], fn(text, row))
                return await in_daemon_thread(fn, text, row)

        try:
            value = await asyncio.wait_for(call(), self.timeout_s)
        except TimeoutError:
            return self.timeout_reward, True
        return value, False

    async def score(self, completion_text: str, row: dict) -> Scored:
        """The weighted sum over the components that return a number (None when none does); with
        several components, each one's value in `parts` as `reward/<name>`."""
        results = await asyncio.gather(*(self._component(fn, completion_text, row) for _, fn in self.components))
        self._count([(name, fn) for (name, fn), (_, late) in zip(self.components, results) if late])
        if (
            self.weighted is None
        ):  # as it came: the rollout checks drop a non-number (`rollout/dropped_nonnumeric_reward`)
            [(value, late)] = results
            return Scored(cast(Optional[float], value), {}, late)  # checked by the rollout
        total, parts = self.weighted.combine([value for value, _ in results])  # a weighted non-number: TypeError
        return Scored(total, parts, any(late for _, late in results))

    def _count(self, late: list[tuple[str, SyncOrAsyncReward]]) -> None:
        """Count one scored sample, `late` its components that missed the deadline; say the first
        substitution; raise `RewardTimeouts` when substitutes fill the recent window past the bound."""
        self.samples += 1
        self._recent.append(bool(late))
        if not late:
            return
        self.timed_out += 1
        what = ", ".join(
            f"{reward_label(fn)}" + (f" (component {name})" if len(self.components) > 1 else "") for name, fn in late
        )
        if self.timed_out == 1:
            log.warning(
                "reward.timeout_s=%g: the reward %s did not answer in time, so the sample scores "
                "reward.timeout_reward=%g in its place and trains on it as if it were its reward (counted in %s; "
                "said once, the total at the end of the run)",
                self.timeout_s,
                what,
                self.timeout_reward,
                TIMED_OUT_METRIC,
            )
        late_share = sum(self._recent) / len(self._recent)
        if len(self._recent) == TIMEOUT_WINDOW and late_share > self.max_timeout_share:
            raise RewardTimeouts(
                f"reward.timeout_s={self.timeout_s:g}: {sum(self._recent)} of the last {TIMEOUT_WINDOW} samples "
                f"scored reward.timeout_reward={self.timeout_reward:g} in place of their reward, more than "
                f"reward.max_timeout_share={self.max_timeout_share:g} of them: the reward {what} is down or too slow, "
                "and the policy would learn from stand-ins"
            )

    def timeout_summary(self, timed_out: int, samples: int) -> str:
        """The end-of-run line: `timed_out` of `samples` samples (every rank's) scored the substitute."""
        return (
            f"reward.timeout_s={self.timeout_s:g}: {timed_out} of {samples} samples scored "
            f"reward.timeout_reward={self.timeout_reward:g} in place of their reward ({TIMED_OUT_METRIC})"
        )

    def score_all_blocking(self, items: list[tuple[str, dict]]) -> list[Scored]:
        """`score` of each `(completion_text, row)`, concurrently, from code that is not in an event
        loop (an evaluation on the training thread)."""

        async def all_of() -> list[Scored]:
            return list(await asyncio.gather(*(self.score(text, row) for text, row in items)))

        return asyncio.run(all_of()) if items else []


def reward_scorer(extras: dict) -> RewardScorer:
    """The run's scorer from a rollout's `setup.extras` (`reward_scorer`, which the run builds from
    the `reward` config), or a default one around `extras["reward_fn"]` (a rollout built by hand)."""
    scorer = extras.get("reward_scorer")
    return scorer if scorer is not None else RewardScorer(extras["reward_fn"])
