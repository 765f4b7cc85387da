"""A rank lost under Lightning's own launcher (`trainer.devices=2`, DDP and FSDP2 on gloo) stops the
others within seconds with one message naming it and the last saved checkpoint, exit code 2, no
traceback, no process left, the last checkpoint whole: a rank killed (rank 1, or rank 0, which
launched rank 1), a rank frozen (SIGSTOP: no connection reset, only its silence), and an error on
one rank alone. Then `resume=auto` finishes the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_grpo.run.checkpoint import verify

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
STOP_WITHIN_S = 60
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RUN = [
    "+experiment=arithmetic",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "checkpoint.save_interval=2",
    "trainer.enable_progress_bar=false",
    "output_model_id=null",
    "callbacks=none",
    "guards.peer_heartbeat_s=0.5",
    "guards.peer_timeout_s=8",
    "rollout.factory=peer_fault_rollouts:make_faulty_rollout_fn",
]


def start(run_dir: Path, *overrides: str, main: str = "lit_grpo.train", env: dict | None = None) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            main,
            *RUN,
            *overrides,
            f"output_dir={run_dir}",
            f"hydra.run.dir={run_dir}",
            f"+rollout.extras.record_dir={run_dir}",
        ],
        cwd=run_dir.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """Rank -> pid: the launcher is rank 0, its child `python` processes the other local ranks."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return {0: launcher.pid, **{1 + i: int(pid) for i, pid in enumerate(children)}}


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, checkpoints: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    root = run_dir / "checkpoints"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before the fault (code {proc.returncode}): {proc.stderr.read()[-3000:]}")
        if root.is_dir() and len([p for p in root.glob("step_*") if p.is_dir()]) >= checkpoints:
            return
        time.sleep(0.2)
    pytest.fail("the run saved no checkpoint in time")


def stopped(proc: subprocess.Popen, since: float) -> tuple[float, str]:
    try:
        _, err = proc.communicate(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {STOP_WITHIN_S} s after the fault")
    return time.monotonic() - since, err


def assert_nothing_left(run_dir: Path) -> None:
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"output_dir={run_dir}"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"


def assert_one_clean_message(err: str, *expected: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def assert_checkpoints_whole(run_dir: Path) -> None:
    steps = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    assert steps
    for step in steps:
        assert verify(step) is None, step


def wait_for_a_checkpoint_in_progress(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until a checkpoint's staging folder exists (its shards being written), polled every 2 ms."""
    deadline = time.monotonic() + timeout_s
    root = run_dir / "checkpoints"
    while time.monotonic() < deadline and proc.poll() is None:
        if root.is_dir() and any(p.name.startswith(".tmp-step_") for p in root.iterdir()):
            return
        time.sleep(0.002)
    pytest.fail("no checkpoint was seen in progress")


@pytest.mark.parametrize(
    "strategy, moment",
    [
        pytest.param("ddp", "training", marks=pytest.mark.nightly),  # the rehearsal's kills cover it in CI
        ("fsdp2", "training"),
        ("ddp", "checkpoint"),
        pytest.param("fsdp2", "checkpoint", marks=pytest.mark.nightly),
    ],
)
def test_a_killed_rank_1_stops_rank_0_with_its_name_and_the_run_resumes(strategy, moment, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "max_steps=400", f"trainer.strategy={strategy}")
    wait_for_steps(run_dir, proc, 2)
    if moment == "checkpoint":
        wait_for_a_checkpoint_in_progress(run_dir, proc)
    os.kill(rank_pids(proc)[1], signal.SIGKILL)
    took, err = stopped(proc, time.monotonic())
    assert proc.returncode == 2
    line = assert_one_clean_message(
        err, "rank 1 (pid", "ended with SIGKILL", "Rank 0 stops", "last saved checkpoint is step"
    )
    assert took < 15, f"{took:.1f} s"  # the launcher sees its child end within a clock tick
    assert_nothing_left(run_dir)
    assert_checkpoints_whole(run_dir)
    saved = int(line.split("last saved checkpoint is step ")[1].split(":")[0])
    assert (run_dir / "checkpoints" / f"step_{saved:08d}").is_dir()

    resumed = start(run_dir, "max_steps=" + str(saved + 4), f"trainer.strategy={strategy}", "resume=auto")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert (run_dir / "checkpoints" / f"step_{saved + 4:08d}").is_dir()


def test_killing_rank_0_the_launcher_takes_rank_1_with_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "max_steps=400", "trainer.strategy=ddp")
    wait_for_steps(run_dir, proc, 2)
    rank1 = rank_pids(proc)[1]
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while Path(f"/proc/{rank1}").exists() and time.monotonic() - killed < STOP_WITHIN_S:
        time.sleep(0.2)
    assert not Path(f"/proc/{rank1}").exists(), "rank 1 outlived its launcher"
    assert time.monotonic() - killed < 15
    assert_nothing_left(run_dir)
    assert_checkpoints_whole(run_dir)


def test_a_frozen_rank_is_found_by_its_silence(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "max_steps=400", "trainer.strategy=ddp")
    wait_for_steps(run_dir, proc, 2)
    frozen = time.monotonic()
    os.kill(rank_pids(proc)[1], signal.SIGSTOP)  # no reset, no exit: only its heartbeat stops
    took, err = stopped(proc, frozen)
    assert proc.returncode == 2
    assert_one_clean_message(err, "rank 1 (", "sent no heartbeat", "guards.peer_timeout_s=8", "Rank 0 stops")
    assert 8 <= took < 8 + 0.5 + 1 + 5 + 10  # timeout + a beat + a clock tick + the handover, with slack
    assert_nothing_left(run_dir)
    assert_checkpoints_whole(run_dir)


def test_an_error_on_one_rank_alone_stops_the_other_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "max_steps=400", "trainer.strategy=ddp", "+rollout.extras.fail_rank=1", "+rollout.extras.fail_after=60"
    )
    started = time.monotonic()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    # Rank 1's own report of its bug (with its traceback: it is a bug), and rank 0's one line, naming it.
    peer_lines = [line for line in err.splitlines() if line.startswith("error: rank 1")]
    assert len(peer_lines) == 1, err[-3000:]
    assert "stopped with an error: rollout_fn failed on 5 rows in a row" in peer_lines[0]  # rank 1's own message
    assert time.monotonic() - started < 240
    assert_nothing_left(run_dir)


def test_a_weight_sync_failing_on_one_rank_between_checkpoints_stops_both(tmp_path):
    """Rank 1's weight sync fails after step 3 (its server's engine died mid-sync), a step with no
    checkpoint due: it saves nothing (a save's collectives would meet rank 0 in its next step and wait
    forever: the cluster rehearsal's hang), names the last checkpoint, and rank 0 stops on its note."""
    run_dir = tmp_path / "run"
    fault = {"LIT_GRPO_TEST_SYNC_FAIL_RANK": "1", "LIT_GRPO_TEST_SYNC_FAIL_AT": "3"}
    proc = start(run_dir, "max_steps=400", "trainer.strategy=ddp", main="weight_sync_fault_main", env=fault)
    took, err = stopped(proc, time.monotonic())
    assert proc.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    mine = [line for line in err.splitlines() if line.startswith("error: weight sync to version 3 failed")]
    peer = [line for line in err.splitlines() if line.startswith("error: rank 1")]
    assert len(mine) == 1 and len(peer) == 1, err[-3000:]
    assert "it continues from step 2, the last checkpoint" in mine[0]
    assert "the last saved checkpoint is step 2" in peer[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert_nothing_left(run_dir)
    assert_checkpoints_whole(run_dir)
