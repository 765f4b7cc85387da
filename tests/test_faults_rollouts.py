"""Hostile rollouts through the real training entry: each stops the run with its own error (or is
counted and survived), within seconds, never a silent stall.

Each case runs `lit_grpo.train.train` on the arithmetic demo with small settings (2 prompts × 4
completions, `guards.max_rows_without_progress=8`, `guards.rollout_timeout_s=1`); a rollout that blocks the
trainer's thread runs in a subprocess (`python tests/hostile_rollouts.py <overrides>`), since the
watchdog interrupts the main thread.
`pytest --durations=0` shows how long each case takes to stop (model build included).
"""

from __future__ import annotations

import asyncio
import csv
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import hostile_rollouts
import pytest
from conftest import compose_config

import lit_grpo.train
from lit_grpo.rollouts import NoProgressError, RolloutCircuitOpen
from lit_grpo.samplers.arguments import PromptTooLong, SamplerTimeout
from lit_grpo.samplers.base import BatchingSampler
from lit_grpo.types import Completion

REPO = Path(__file__).resolve().parents[1]
SMALL = (
    "+experiment=arithmetic",
    "max_steps=2",
    "data.prompt_groups_per_step=2",
    "data.completions_per_prompt=4",
    "guards.max_rows_without_progress=8",
    "guards.rollout_timeout_s=1",
    "trainer.enable_progress_bar=false",
    "output_model_id=null",
    "~callbacks.reward_curve",
)


@pytest.fixture
def run(monkeypatch, tmp_path):
    """`run(*overrides)`: train the small config with those overrides; returns (summary, seconds)."""

    def go(*overrides: str):
        start = time.perf_counter()
        summary = lit_grpo.train.train(compose_config(*SMALL, *overrides, output_dir=tmp_path))
        return summary, time.perf_counter() - start

    return go


def _factory(name: str) -> str:
    return f"rollout.factory=hostile_rollouts:make_{name}"


# --------------------------------------------------------------------------- malformed output: no progress


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "factory,reason,shown",
    [
        ("always_none", "none", "returned None"),
        ("dict", "not_a_sample", "returned a dict with keys"),
        ("tuple", "not_a_sample", "returned a tuple ("),
        ("ragged", "length_mismatch", "logprobs"),
        ("nan_reward", "nonfinite_reward", "reward nan"),
        ("inf_reward", "nonfinite_reward", "reward inf"),
        ("string_reward", "nonnumeric_reward", "(str)"),
        ("out_of_vocab", "bad_token", "the vocabulary is [0,"),
        ("mask_two", "bad_mask", "loss_mask values ['2']"),
        ("positive_logprob", "bad_logprob", "[0.5]"),
    ],
)
def test_a_rollout_that_never_gives_a_usable_sample_stops_the_run(run, factory, reason, shown):
    with pytest.raises(NoProgressError) as stopped:
        run(_factory(factory), "offpolicy.synchronous=true")
    message = str(stopped.value)
    assert "guards.max_rows_without_progress=8" in message
    assert f"       8  {reason}:" in message  # all 8 rows, by their reason
    assert f"rollout/dropped_{reason}" in message  # and their samples, by metric
    assert shown in message and "Check: " in message
    if reason == "not_a_sample":  # the user's rollout function, named with its file and line
        assert f"factory.<locals>.rollout_fn ({hostile_rollouts.__file__}:" in message


@pytest.mark.timeout(120)
def test_no_progress_stops_the_off_policy_scheduler_too(run):
    with pytest.raises(NoProgressError, match=r"(?s)8  none:.*Check: the rollout function returns None"):
        run(_factory("always_none"), "offpolicy.synchronous=false")


@pytest.mark.timeout(120)
def test_every_group_uniform_with_the_filter_on_names_the_temperature(run):
    # Near-greedy sampling: the G completions of a prompt are identical, so are their rewards.
    with pytest.raises(
        NoProgressError, match=r"(?s)8  filtered_groups:.*sampler\.temperature.*~callbacks\.reward_filter"
    ):
        run("sampler.temperature=1e-6", "offpolicy.synchronous=true")


@pytest.mark.timeout(120)
def test_prompts_longer_than_max_seq_len_are_never_sampled(run, monkeypatch):
    sent = []
    real_generate = BatchingSampler.generate
    monkeypatch.setattr(
        BatchingSampler, "generate", lambda self, prompts, *a: sent.append(prompts) or real_generate(self, prompts, *a)
    )
    with pytest.raises(NoProgressError, match=r"(?s)8  prompt_too_long:.*data\.max_seq_len is 3"):
        run("data.max_seq_len=3")  # every arithmetic prompt ("3+4=") is 4 tokens
    assert sent == []


# --------------------------------------------------------------------------- deadlines and errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("synchronous", ["true", "false"])
def test_a_rollout_that_sleeps_forever_is_cancelled_and_trips_the_breaker(run, synchronous):
    start = time.perf_counter()
    with pytest.raises(
        RolloutCircuitOpen, match=r"RolloutTimeout.*guards.rollout_timeout_s=1 s.*raise guards.rollout_timeout_s"
    ):
        run(_factory("sleeps_forever"), "guards.rollout_max_retries=1", f"offpolicy.synchronous={synchronous}")
    assert time.perf_counter() - start < 60  # 1 s deadline, one retry after 0.5 s, model build


@pytest.mark.timeout(120)
def test_a_bug_in_the_rollout_stops_at_once_with_its_traceback(run):
    with pytest.raises(TypeError) as stopped:
        run(_factory("type_error"))
    frames = [frame.name for frame in stopped.traceback]
    assert "rollout_fn" in frames  # the user's frame, not a wrapper's
    assert any("a bug in the rollout stops training at once" in note for note in stopped.value.__notes__)


@pytest.mark.timeout(120)
def test_a_flaky_environment_is_retried_and_training_goes_on(run, tmp_path):
    summary, _ = run(_factory("flaky_connection"), "offpolicy.synchronous=true", "~callbacks.reward_filter")
    assert summary["steps"] == 2
    steps = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    total = lambda key: sum(float(s[key]) for s in steps if s.get(key))  # noqa: E731
    assert total("rollout/retries") == hostile_rollouts.FLAKY_FAILURES
    assert total("rollout/failures") == 0


def _totals(tmp_path: Path, *keys: str) -> list[float]:
    steps = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    return [sum(float(s[key]) for s in steps if s.get(key)) for key in keys]


@pytest.mark.timeout(300)
def test_a_reward_that_raises_for_one_prompt_in_55_drops_those_samples_and_trains_to_the_end(run, tmp_path):
    summary, _ = run(
        "reward.fn=hostile_rollouts:reward_fails_on_one_prompt_in_55", "max_steps=30", "~callbacks.reward_filter"
    )
    assert summary["steps"] == 30
    (failures,) = _totals(tmp_path, "rollout/failures")
    assert failures > 0  # the drops are counted


@pytest.mark.timeout(120)
def test_a_reward_that_always_raises_still_stops_the_run(run):
    with pytest.raises(RolloutCircuitOpen, match=r"rows in a row.*the grader is down"):
        run("reward.fn=hostile_rollouts:reward_always_fails")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("error", ["runtime_error", "connection_error"])
@pytest.mark.parametrize("retried", [False, True])
def test_a_30_percent_flaky_reward_trains_through_retried_as_configured(run, tmp_path, error, retried):
    """30 % of the reward's calls raise: each failing sample is dropped, or retried when its
    exception is in rollout_retry_on (ConnectionError by default, RuntimeError when listed)."""
    retry_on = (
        "guards.rollout_retry_on=[ConnectionError,RuntimeError]"
        if retried
        else "guards.rollout_retry_on=[ConnectionError]"
    )
    summary, _ = run(
        f"reward.fn=hostile_rollouts:reward_flaky_{error}",
        retry_on,
        "max_steps=6",
        "~callbacks.reward_filter",
        "guards.rollout_timeout_s=30",  # a retry backs off 0.5 s, then 1 s
    )
    assert summary["steps"] == 6
    failures, retries = _totals(tmp_path, "rollout/failures", "reward/retries")
    if retried or error == "connection_error":  # retried per sample: few are left to drop
        assert retries > 0 and failures <= 0.1 * 6 * 8
    else:  # dropped, each one alone
        assert retries == 0 and failures > 0.15 * 6 * 8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_synchronous_reward_that_hangs_on_one_call_delays_only_its_own_sample(run, tmp_path):
    """The 5th reward call sleeps 20 s, past guards.rollout_timeout_s=10: it runs off the event loop, so
    the other samples keep flowing; its sample is cut at the deadline and retried, and the run ends."""
    summary, seconds = run(
        "reward.fn=hostile_rollouts:reward_slow_once",
        "guards.rollout_timeout_s=10",
        "max_steps=3",
        "~callbacks.reward_filter",
    )
    assert summary["steps"] == 3 and seconds < 60
    (timeouts,) = _totals(tmp_path, "rollout/timeouts")
    assert timeouts >= 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rollout_that_blocks_its_loop_ends_with_one_message_and_nothing_after_it(tmp_path):
    """From the command line: the watchdog's message is the last thing printed, with no asyncio
    clean-up noise (pending tasks, exceptions never retrieved, a closed loop) after it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    args = [*SMALL, _factory("blocking"), "guards.rollout_timeout_s=2", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    for noise in ("Task was destroyed", "never retrieved", "Event loop is closed", "Traceback"):
        assert noise not in output, output[-3000:]
    tail = output.strip().splitlines()[-1]
    assert tail == "error: the rollout event loop was blocked", output[-3000:]
    assert "time.sleep(10**6)" in output and "must not block its event loop" in output  # the line, and the fix


@pytest.mark.timeout(120)
def test_huge_rewards_keep_finite_statistics(run, tmp_path):
    run(_factory("huge_reward"), "offpolicy.synchronous=true", "~callbacks.reward_filter")
    steps = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    for key in ("reward/mean", "reward/std", "reward/max"):
        values = [float(s[key]) for s in steps if s.get(key)]
        assert values and all(abs(v) < float("inf") for v in values), key


def _cli(tmp_path: Path, *overrides: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "hostile_rollouts.py"), *SMALL, *overrides, f"output_dir={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("synchronous", ["true", "false"])
def test_a_rollout_that_blocks_the_event_loop_is_named(tmp_path, synchronous):
    proc, seconds = _cli(tmp_path, _factory("blocking"), f"offpolicy.synchronous={synchronous}", timeout=150)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "RolloutStalled" in err, err[-3000:]
    assert "make_blocking.<locals>.rollout_fn" in err and "time.sleep(10**6)" in err
    assert "asyncio.to_thread" in err
    print(f"blocked rollout (offpolicy.synchronous={synchronous}) stopped the CLI in {seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine_thread,shown", [("loop", "RolloutStalled"), ("worker", "RolloutCircuitOpen")])
def test_a_hung_engine_call_stops_the_run_on_either_thread(tmp_path, engine_thread, shown):
    # On the loop's thread the heartbeat is the engine call's deadline (the watchdog interrupts
    # it); on the worker the call's own bound fails the rollouts until the breaker opens.
    proc, seconds = _cli(tmp_path, _factory("stuck_engine"), f"sampler.engine_thread={engine_thread}", timeout=150)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert shown in err, err[-3000:]
    if engine_thread == "loop":
        assert "hung_generate" in err  # the stall report shows where the loop's thread is stuck
    else:
        assert "guards.rollout_timeout_s=1 s" in err
    print(f"hung engine call (engine_thread={engine_thread}) stopped the CLI in {seconds:.1f} s")


# --------------------------------------------------------------------------- the sampler's own bounds


class _StuckSampler(BatchingSampler):
    """A sampler whose engine takes `seconds` per batched call."""

    def __init__(self, tokenizer, seconds: float) -> None:
        super().__init__(tokenizer)
        self.seconds = seconds

    def _generate(self, prompts, temperature, max_tokens):
        time.sleep(self.seconds)
        return [Completion(list(p) + [1], len(p), [-0.1], "length", "x") for p in prompts]

    def _load(self, named_tensors):
        pass


@pytest.mark.timeout(30)
def test_a_sampler_call_has_a_deadline_and_a_prompt_limit(tokenizer):
    sampler = _StuckSampler(tokenizer, seconds=1.5)
    sampler.call_timeout_s, sampler.max_seq_len = 0.2, 8
    start = time.perf_counter()
    with pytest.raises(SamplerTimeout, match="did not return within 0.2 s"):
        asyncio.run(sampler.sample_with_prompt_tokens([1, 2, 3], temperature=1.0, max_tokens=1))
    assert time.perf_counter() - start < 1.0
    with pytest.raises(PromptTooLong, match="8 tokens"):
        asyncio.run(sampler.sample_with_prompt_tokens(list(range(8)), temperature=1.0, max_tokens=1))
    sampler.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("on_loop", [True, False])
def test_engine_calls_run_on_the_loops_thread_or_the_worker(tokenizer, on_loop):
    sampler = _StuckSampler(tokenizer, seconds=0.0)
    sampler.engine_on_loop = on_loop
    threads = []
    sampler.generate = lambda prompts, *a: (
        threads.append(threading.get_ident()) or BatchingSampler.generate(sampler, prompts, *a)
    )

    async def two_requests():
        got = await asyncio.gather(
            *(sampler.sample_with_prompt_tokens([1, 2, i], temperature=1.0, max_tokens=1) for i in (3, 4))
        )
        return got, threading.get_ident()

    (first, second), loop_thread = asyncio.run(two_requests())
    assert [c.full_tokens for c in first + second] == [[1, 2, 3, 1], [1, 2, 4, 1]]
    assert len(threads) == 1  # one batched call either way
    assert (threads[0] == loop_thread) is on_loop
    sampler.close()


@pytest.mark.timeout(30)
def test_a_stop_raised_inside_an_engine_call_on_the_loop_is_not_logged_again_at_exit(tokenizer, caplog):
    # A stop signal's KeyboardInterrupt raised inside the engine call ends the run; the flush task
    # it also ended must not be reported by asyncio as an exception nobody retrieved.
    class Stop(KeyboardInterrupt):
        pass

    def interrupted(*args):
        raise Stop()

    sampler = _StuckSampler(tokenizer, seconds=0.0)
    sampler.engine_on_loop, sampler._generate = True, interrupted
    loop = asyncio.new_event_loop()
    with pytest.raises(Stop):
        loop.run_until_complete(sampler.sample_with_prompt_tokens([1, 2], temperature=1.0, max_tokens=1))
    pending = asyncio.all_tasks(loop)  # the request, as on the worker thread: still waiting
    assert pending
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
    del loop, pending, task
    gc.collect()
    assert "never retrieved" not in caplog.text
    sampler.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "setting,synchronous,on_loop",
    [("auto", True, True), ("auto", False, False), ("worker", True, False), ("loop", False, True)],
)
def test_engine_thread_setting_resolves_by_the_training_mode(setting, synchronous, on_loop):
    from lit_grpo.config.sampler import engine_on_loop

    assert engine_on_loop(setting, synchronous) is on_loop


@pytest.mark.timeout(30)
def test_the_default_rollout_never_sends_a_templated_prompt_that_is_too_long(tokenizer):
    from lit_grpo.rollouts import GroupSampler
    from lit_grpo.rollouts.rollout import make_rollout_fn
    from lit_grpo.types import RolloutSetup

    sampler = _StuckSampler(tokenizer, seconds=0.0)
    sampler.max_seq_len = 32
    sent = []
    sampler.generate = lambda prompts, *a: sent.append(prompts) or BatchingSampler.generate(sampler, prompts, *a)
    setup = RolloutSetup(
        sampler, tokenizer, {"temperature": 1.0, "max_tokens": 1}, {"reward_fn": lambda text, row: 1.0}
    )
    groups = GroupSampler(make_rollout_fn(setup), 2, max_seq_len=32, min_group_size=2, filters=[])
    long_row = {"messages": [{"role": "user", "content": "x" * 40}]}
    group = asyncio.run(groups.sample(long_row, version=0))
    assert group.samples == [] and group.dropped == {"rollout/dropped_prompt_too_long": 2}
    assert sent == [] and groups.breaker.consecutive == 0  # a drop, not a failure
    short = asyncio.run(groups.sample({"messages": [{"role": "user", "content": "1+1="}]}, version=0))
    assert len(short.samples) == 2 and len(sent) == 1
    sampler.close()
