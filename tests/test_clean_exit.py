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
