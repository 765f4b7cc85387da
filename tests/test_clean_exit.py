"""A clean exit: every thread a run starts is stopped and joined when it ends, and a finished run's
process exits 0, every time (issue 32: a finished multirun once aborted with SIGABRT at exit)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.rollouts.deadlines import Heartbeat, LoopWatchdog
from lit_grpo.samplers.worker import THREAD_PREFIX, DaemonWorker, run_threads
from lit_grpo.train import train

REPO = Path(__file__).resolve().parents[1]
SHORT_RUN = ["+experiment=arithmetic", "max_steps=3", "trainer.enable_progress_bar=false"]
REPEATS = 20


def cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *SHORT_RUN, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("synchronous", [True, False], ids=["synchronous", "off_policy"])
def test_no_thread_of_the_run_outlives_train(tmp_path, synchronous):
    before = set(threading.enumerate())
    summary = train(
        compose_config(*SHORT_RUN, f"offpolicy.synchronous={str(synchronous).lower()}", output_dir=tmp_path)
    )
    assert summary["steps"] == 3
    # The run's own threads (the sampler's worker, the watchdog, the scheduler's event loop) are
    # joined; threads other tests in this process left behind are not this run's.
    assert [t.name for t in run_threads() if t not in before] == []
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads left running after train() returned: {left}"


@pytest.mark.timeout(60)
def test_the_watchdog_thread_is_joined_at_once_when_closed():
    watchdog = LoopWatchdog(Heartbeat(0.05), deadline_s=60.0, describe=lambda stale, thread: "")
    with watchdog.watching():
        pass
    thread = watchdog._thread
    assert thread is not None and thread.name == THREAD_PREFIX + "rollout-watchdog" and thread.is_alive()
    start = time.monotonic()
    watchdog.close()
    assert not thread.is_alive() and time.monotonic() - start < 2.0  # not its 60 s idle wait


@pytest.mark.timeout(60)
def test_a_stuck_engine_call_is_abandoned_after_its_bound_with_a_warning(caplog):
    worker, release = DaemonWorker("stuck-test"), threading.Event()
    worker.submit(release.wait)
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="lit_grpo.samplers.worker"):
        start = time.monotonic()
        assert worker.close(timeout_s=0.2) is False
    assert time.monotonic() - start < 2.0
    assert "did not end within 0.2 s" in caplog.text and THREAD_PREFIX + "stuck-test" in caplog.text
    release.set()
    worker.join(5.0)
    assert not worker._thread.is_alive()


@pytest.mark.timeout(120)
def test_the_cli_exits_with_its_code_past_a_thread_that_never_ends(tmp_path):
    # The last resort (`lit_grpo.train.exit_past_stuck_threads`): a lit_grpo thread still stuck after
    # the run (in C++ it could abort the interpreter's shutdown) does not change the exit code.
    script = (
        "import threading, time\n"
        "from lit_grpo.train import exit_past_stuck_threads\n"
        "threading.Thread(target=time.sleep, args=(600,), name='lit_grpo-stuck', daemon=True).start()\n"
        "print('run finished', flush=True)\n"
        "exit_past_stuck_threads(0, wait_s=0.2)\n"
        "raise SystemExit(3)  # not reached\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "run finished" in proc.stdout and "lit_grpo-stuck" in proc.stderr


@pytest.mark.slow
@pytest.mark.nightly  # 20 runs (~100 s): a repetition of what the slow lane checks once
@pytest.mark.timeout(1800)
def test_a_finished_run_exits_0_every_time(tmp_path):
    """20 finished 3-step runs of the CLI, each its own process, two at a time (a run is mostly
    start-up and imports, one core each): every exit code is 0."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda i: cli(tmp_path / f"run{i}"), range(REPEATS)))
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"run {i} exited {proc.returncode}: {proc.stderr[-3000:]}"
        assert "stopped: max_steps=3 reached" in proc.stdout
    assert [p.returncode for p in procs] == [0] * REPEATS


def _long_completion_sampler():
    """An hf sampler on a random 4096-id model: eos is 1 of 4096 ids, so every completion runs to `max_tokens`."""
    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import load_policy, load_tokenizer
    from lit_grpo.samplers.hf import HFSampler

    cfg = ModelConfig(kind="qwen2_shape", vocab_size=4096, max_position_embeddings=4096)
    tokenizer = load_tokenizer(cfg)
    return HFSampler(load_policy(cfg, tokenizer, seed=0), tokenizer, max_batch_size=2)


@pytest.mark.timeout(120)
def test_cancel_ends_a_running_hf_generate_at_its_next_token():
    from lit_grpo.samplers.arguments import SamplerClosed

    sampler = _long_completion_sampler()
    outcome: dict[str, object] = {}

    def generate() -> None:
        try:
            outcome["completions"] = sampler.generate([[10, 11, 12], [13, 14]], 1.0, 4000)
        except SamplerClosed as err:
            outcome["error"] = err

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(1.0)  # well into the 4000 tokens (several seconds on a CPU)
    assert thread.is_alive(), "the call ended before it was cancelled: make it longer"
    start = time.monotonic()
    sampler.cancel()
    thread.join(5.0)
    assert not thread.is_alive() and time.monotonic() - start < 2.0
    assert isinstance(outcome.get("error"), SamplerClosed), outcome  # partial completions are never returned
    with pytest.raises(SamplerClosed):  # and nothing generates any more
        sampler.generate([[10, 11]], 1.0, 4)
    sampler.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_that_stops_mid_generation_ends_at_once_and_cleanly(tmp_path):
    # Off-policy: the next step's rows are being sampled when the last step ends, each completion
    # 5000 tokens long (a random model of 4096 ids almost never samples eos): tens of seconds on a CPU.
    proc = subprocess.run(
        [
            sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", "max_steps=1",
            "trainer.enable_progress_bar=false", "synchronous_training=false", "callbacks=none",
            "data.prompt_groups_per_step=1", "data.completions_per_prompt=2", "sampler.max_batch_size=2",
            "sampler.max_completion_tokens=5000", "data.max_seq_len=5050", "model.kind=qwen2_shape",
            "model.vocab_size=4096", "model.max_position_embeddings=5050", f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "stopped: max_steps=1 reached" in output
    assert "abandoned" not in output and "threads still running" not in output, output[-3000:]
    # The run's end (the export is its last callback; then the data module closes) takes no longer
    # than the close itself: the in-flight call was cut, not waited for (it had seconds to go).
    stamps = {
        key: datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
        for line in output.splitlines()
        for key in ("exported the trained policy", "run summary")
        if key in line
    }
    end_s = (stamps["run summary"] - stamps["exported the trained policy"]).total_seconds()
    assert end_s < 2.0, f"the run's end took {end_s:.1f} s: it waited for the in-flight generation"
