"""Rollout functions that misbehave on purpose, for the fault tests (`tests/test_faults_rollouts.py`).

Each `make_*` is a `make_rollout_fn(setup)` factory, used as `rollout.factory=hostile_rollouts:make_*`.
Most wrap the default rollout and break its output one way. Run as a script,
`python tests/hostile_rollouts.py +experiment=arithmetic ...` composes the config from its
arguments and runs `lit_grpo.train.train` on the main thread of its own process, with the rollout
guards wired into the data module: for a rollout that blocks the trainer's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable

from lit_grpo.rollouts.rollout import make_rollout_fn
from lit_grpo.types import RolloutSample, RolloutSetup


def _corrupting(change: Callable[[RolloutSample, RolloutSetup], object]):
    """A factory whose rollout is the default one with `change` applied to each sample."""

    def factory(setup: RolloutSetup):
        inner = make_rollout_fn(setup)

        async def rollout_fn(row):
            return change(await inner(row), setup)

        return rollout_fn

    return factory


def _generated(sample: RolloutSample, value):
    """`value` on the generated tokens (mask 1), the sample's own values elsewhere."""
    return [value if m else lp for lp, m in zip(sample.logprobs, sample.loss_mask)]


make_always_none = _corrupting(lambda s, setup: None)
make_dict = _corrupting(lambda s, setup: dataclasses.asdict(s))
make_tuple = _corrupting(lambda s, setup: (s.tokens, s.logprobs, s.loss_mask, s.reward))
make_ragged = _corrupting(lambda s, setup: dataclasses.replace(s, logprobs=s.logprobs[:-1]))
make_nan_reward = _corrupting(lambda s, setup: dataclasses.replace(s, reward=math.nan))
make_inf_reward = _corrupting(lambda s, setup: dataclasses.replace(s, reward=math.inf))
make_string_reward = _corrupting(lambda s, setup: dataclasses.replace(s, reward=str(s.reward)))
make_out_of_vocab = _corrupting(
    lambda s, setup: dataclasses.replace(s, tokens=[*s.tokens[:-1], len(setup.tokenizer) + 5])
)
make_mask_two = _corrupting(lambda s, setup: dataclasses.replace(s, loss_mask=[2 * m for m in s.loss_mask]))
make_positive_logprob = _corrupting(lambda s, setup: dataclasses.replace(s, logprobs=_generated(s, 0.5)))
make_huge_reward = _corrupting(lambda s, setup: dataclasses.replace(s, reward=s.reward * 1e200))


def make_sleeps_forever(setup: RolloutSetup):
    async def rollout_fn(row):
        await asyncio.sleep(10**9)

    return rollout_fn


def make_blocking(setup: RolloutSetup):
    async def rollout_fn(row):
        time.sleep(10**6)  # blocks the event loop: the mistake the watchdog names

    return rollout_fn


def make_stuck_engine(setup: RolloutSetup):
    """The default rollout on a sampler whose engine call never returns (a hung generate)."""

    def hung_generate(prompts, temperature, max_tokens, stop=()):
        time.sleep(10**6)

    setup.sampler._generate = hung_generate
    return make_rollout_fn(setup)


def make_type_error(setup: RolloutSetup):
    async def rollout_fn(row):
        return row["prompt"] + 1  # str + int: a bug in the rollout

    return rollout_fn


FLAKY_FAILURES = 3


def make_flaky_connection(setup: RolloutSetup):
    """The default rollout, after its environment refused the first FLAKY_FAILURES calls."""
    inner = make_rollout_fn(setup)
    calls = {"n": 0}

    async def rollout_fn(row):
        calls["n"] += 1
        if calls["n"] <= FLAKY_FAILURES:
            raise ConnectionError(f"environment not up yet (call {calls['n']})")
        return await inner(row)

    return rollout_fn


def _row_number(row: dict) -> int:
    import zlib

    return zlib.crc32(str(row.get("prompt")).encode())


def reward_fails_on_one_prompt_in_55(completion: str, row: dict) -> float:
    """The arithmetic reward, which raises for the prompts whose checksum is 0 modulo 55."""
    from lit_grpo.rewards import get_reward

    if _row_number(row) % 55 == 0:
        raise RuntimeError(f"the grader cannot read prompt {row.get('prompt')!r}")
    return get_reward("arithmetic")(completion, row)


def reward_always_fails(completion: str, row: dict) -> float:
    raise RuntimeError("the grader is down")


def _flaky(error: type[Exception]):
    import random

    rng = random.Random(0)

    def reward(completion: str, row: dict) -> float:
        from lit_grpo.rewards import get_reward

        if rng.random() < 0.3:
            raise error("30% of the grader's calls fail")
        return get_reward("arithmetic")(completion, row)

    return reward


_SLOW_CALLS = {"n": 0}


def reward_slow_once(completion: str, row: dict) -> float:
    """A synchronous reward whose 5th call sleeps 20 s (a judge that hangs once)."""
    import time

    from lit_grpo.rewards import get_reward

    _SLOW_CALLS["n"] += 1
    if _SLOW_CALLS["n"] == 5:
        time.sleep(20)
    return get_reward("arithmetic")(completion, row)


reward_flaky_runtime_error = _flaky(RuntimeError)
reward_flaky_connection_error = _flaky(ConnectionError)


if __name__ == "__main__":
    import sys

    import lit_grpo.train

    lit_grpo.train.train(lit_grpo.train.compose_config(sys.argv[1:]))
