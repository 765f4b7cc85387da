"""SIGTERM and SIGINT stop a real CLI run within seconds with exit code 128 + signal, leaving a
checkpoint at the step it stopped on (or the last finished one, when the stop came during a hung
rollout), its metrics and summary; a resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from conftest import compose_config
from test_checkpoint import assert_bit_identical, csv_rewards, run_cli, tensors, uninterrupted  # noqa: F401

pytestmark = pytest.mark.timeout(600)
NO_FILTER = "~callbacks.reward_filter"  # exactly 8 rows × 8 completions per step: call 200 is in step 4


@pytest.fixture(scope="module")
def uninterrupted_no_filter(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted_no_filter") / "run"
    proc = run_cli(run_dir, NO_FILTER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _stop(run_dir, *overrides):
    start = time.perf_counter()
    proc = run_cli(run_dir, *overrides)
    return proc, time.perf_counter() - start


def _resume_matches(run_dir, uninterrupted, stopped_at: int, *overrides: str) -> None:  # noqa: F811
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == stopped_at and summary["stopped_by"] in ("SIGTERM", "SIGINT")
    assert (run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").exists()
    assert not (run_dir / "final_model").exists()  # a stopped run is not a final model
    resumed = run_cli(run_dir, "resume=auto", *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"].endswith(f"step_{stopped_at:08d}")
    assert_bit_identical(tensors(uninterrupted / "final_model"), tensors(run_dir / "final_model"))
    assert csv_rewards(run_dir) == csv_rewards(uninterrupted)


@pytest.mark.slow
def test_sigterm_during_a_step_checkpoints_that_step_and_resumes_exactly(uninterrupted, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    proc, seconds = _stop(run_dir, "+callbacks.term={_target_:fault_injection.SignalAfterStep,step:5}")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    _resume_matches(run_dir, uninterrupted, stopped_at=5)  # 5 is not a multiple of checkpoint.save_interval=2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["offpolicy.synchronous=true", "offpolicy.synchronous=false"])
@pytest.mark.parametrize("name,code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_a_hung_rollout_stops_within_seconds(mode, name, code, uninterrupted_no_filter, tmp_path):
    run_dir = tmp_path / "run"
    proc, seconds = _stop(
        run_dir,
        mode,
        NO_FILTER,
        "rollout.factory=fault_injection:make_hanging_rollout_fn",
        "+rollout.extras.hang_at_call=200",
        f"+rollout.extras.signal={name}",
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert seconds < 60, seconds
    if mode == "offpolicy.synchronous=true":  # asynchronous sampling runs ahead of training: no exact step
        _resume_matches(run_dir, uninterrupted_no_filter, 3, mode, NO_FILTER)
    else:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped_by"] == name and summary["steps"] >= 1
        assert (run_dir / "checkpoints" / f"step_{int(summary['steps']):08d}" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("engine_thread", ["loop", "worker"])
def test_a_signal_during_a_hung_engine_call_stops_within_seconds(engine_thread, tmp_path):
    # On the loop's thread the signal lands inside the engine call itself.
    run_dir = tmp_path / "run"
    proc, seconds = _stop(
        run_dir,
        NO_FILTER,
        f"sampler.engine_thread={engine_thread}",
        "rollout.factory=fault_injection:make_hanging_engine_rollout_fn",
        "+rollout.extras.hang_at_generate=4",
        "+rollout.extras.signal=SIGINT",
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "never retrieved" not in proc.stderr, proc.stderr[-3000:]
    assert seconds < 60, seconds
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] == 3


def test_a_second_signal_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    # The first SIGTERM comes at the end of step 2, whose end then lingers for 300 s; the second,
    # 1 s into it, must end the process at once.
    proc, seconds = _stop(
        run_dir, "+callbacks.term={_target_:fault_injection.SignalAfterStep,step:2,linger_s:300,again_after_s:1}"
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert seconds < 60 and "again: exiting now" in proc.stderr


def test_a_signal_inside_a_rollout_task_stops_with_the_summary_written(tmp_path):
    """The handler can run inside a rollout's asyncio task: that task fails with the stop, and the
    tasks awaiting it raise it again as the scheduler closes. That stop is being handled: it used to
    escape the close and skip the summary (exit 130, no summary.json)."""
    run_dir = tmp_path / "run"
    proc, _ = _stop(
        run_dir,
        NO_FILTER,
        "rollout.factory=fault_injection:make_signalling_rollout_fn",
        "+rollout.extras.signal_at_call=200",  # call 200 is in step 4: steps 1-3 finished
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] == 3
    assert proc.stderr.strip().splitlines()[-1].startswith("stopped by SIGINT: checkpoint step 3, metrics and summary")


def test_closing_the_scheduler_after_a_stop_inside_a_rollout_task_does_not_raise_it_again():
    import asyncio
    import signal

    from lit_grpo.loop.signals import StopRequested
    from lit_grpo.rollouts import GroupSampler, RowCursor, SynchronousScheduler

    async def rollout_fn(row):
        if row["id"] == 1:
            raise StopRequested(signal.SIGINT)  # as the handler raises it inside the task
        await asyncio.sleep(30)  # still running when the stop ends the wait

    groups = GroupSampler(rollout_fn, 2, max_seq_len=64, min_group_size=2, filters=[])
    scheduler = SynchronousScheduler(
        RowCursor([{"id": i} for i in range(4)], 1, 0, shuffle=False), groups, 2, max_concurrency=256
    )
    with pytest.raises(StopRequested):
        scheduler.next_groups()
    start = time.monotonic()
    try:
        scheduler.close()
    except KeyboardInterrupt as again:  # caught: a KeyboardInterrupt would end the whole test session
        pytest.fail(f"closing the scheduler raised the handled stop again: {again!r}")
    assert time.monotonic() - start < 5


def test_a_stop_that_a_garbage_collection_swallowed_is_raised_again_in_the_wait():
    """The handler's StopRequested can land in a weakref callback or a `__del__` run by a garbage
    collection during the wait, where Python only prints it and goes on: the wait must still end."""
    import signal
    import weakref

    from lit_grpo.loop.signals import StopRequested, StopSignals

    class Doomed:
        pass

    def in_the_callback(_) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # Python runs the handler here, inside the callback

    with StopSignals() as stop:
        start = time.monotonic()
        try:
            with stop.interruptible():
                doomed = Doomed()
                watch = weakref.ref(doomed, in_the_callback)  # noqa: F841  kept, so that its callback runs
                del doomed
                while time.monotonic() - start < 5:  # the wait for rollouts
                    time.sleep(0.01)
        except StopRequested:
            pass
        else:
            pytest.fail("the wait ran its whole 5 s: the stop was swallowed")
    assert time.monotonic() - start < 2


def test_a_signal_before_the_run_is_built_leaves_the_summary_and_says_only_that(tmp_path, monkeypatch):
    """A SIGINT while the config is checked (here: as the sources are) used to meet Python's own
    handler: a KeyboardInterrupt traceback and no summary. Now the run stops before it builds
    anything, writes its summary, and its last line claims nothing more."""
    import os
    import signal

    import lit_grpo.train as train_module
    from lit_grpo.loop.signals import StopRequested

    monkeypatch.setattr(train_module, "check_sources", lambda c: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(StopRequested) as stopped:
        train_module.train(compose_config("+experiment=arithmetic", "max_steps=4", output_dir=tmp_path))
    assert stopped.value.report() == "stopped by SIGINT: summary written; no checkpoint: no step had finished"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["stopped_by"] == "SIGINT"
    assert not (tmp_path / "checkpoints").exists()


def test_a_signal_before_train_takes_over_is_the_runs_stop(tmp_path):
    """The CLI catches the stop signals from the process's start: one that comes while Hydra sets
    the run up (before `train`'s own handlers) is handed to `train`, which stops before the build
    with its summary, as for a signal during the config's checks."""
    import signal

    from lit_grpo.loop.signals import StopRequested, StopSignals
    from lit_grpo.train import train

    cli_stop = StopSignals().__enter__()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the handler runs here
        assert cli_stop.signum == signal.SIGINT
        with pytest.raises(StopRequested) as stopped:
            train(compose_config("+experiment=arithmetic", "max_steps=4", output_dir=tmp_path))
    finally:
        cli_stop.__exit__()
    assert stopped.value.report() == "stopped by SIGINT: summary written; no checkpoint: no step had finished"
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by"] == "SIGINT"


STOPS, AT_ONCE = 50, 2


@pytest.mark.slow
@pytest.mark.nightly  # 50 runs (~250 s): the slow lane's single-SIGINT tests run each moment once
@pytest.mark.timeout(900)
def test_fifty_sigints_at_random_moments_each_leave_the_summary_the_stop_line_claims(tmp_path):
    """50 CLI runs, each sent one SIGINT at a random moment after its run folder exists (seeded:
    from validation through the model's build, the steps, checkpoints, the export and the summary
    itself). Every one leaves a whole summary.json; one that says it stopped names only what it
    wrote; none ends in a traceback."""
    import random
    import signal
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from test_checkpoint import REPO, TESTS

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}

    def one(i: int) -> str:
        run_dir = tmp_path / f"run{i}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lit_grpo.train",
                "+experiment=arithmetic",
                "max_steps=60",
                "checkpoint.save_interval=7",
            ]
            + ["trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # A third of the stops come while the run starts (validation, imports, the build), the rest
        # once it trains (steps, checkpoints every 7, the export and the summary at the end).
        rng = random.Random(i)
        marker = run_dir / (".hydra" if i % 3 == 0 else "metrics.csv")
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 4.0 if i % 3 == 0 else 2.5))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.strip()]
        assert (run_dir / "summary.json").is_file(), (i, proc.returncode, err[-3000:])  # whatever the moment
        summary = json.loads((run_dir / "summary.json").read_text())  # and whole
        assert "Traceback" not in err, err[-3000:]
        if proc.returncode == 0 or "after the run ended" in lines[-1]:  # the signal came after the run had finished
            assert "stopped_by" not in summary and summary["steps"] == 60
            return "finished"
        assert proc.returncode == 130 and summary["stopped_by"] == "SIGINT", (proc.returncode, err[-3000:])
        claim = lines[-1]
        assert claim.startswith("stopped by SIGINT: ") and "summary" in claim, claim
        saved = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")]
        if "checkpoint step" in claim:
            step = int(claim.split("checkpoint step ")[1].split(",")[0].split(" ")[0])
            assert step in saved and (run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json").exists()
        else:
            assert "no checkpoint" in claim and not saved, (claim, saved)
        return f"stopped at step {summary['steps']:.0f}"

    with ThreadPoolExecutor(AT_ONCE) as pool:
        outcomes = list(pool.map(one, range(STOPS)))
    print({o: outcomes.count(o) for o in sorted(set(outcomes))})
    assert len(outcomes) == STOPS and sum(o.startswith("stopped") for o in outcomes) >= STOPS // 2
