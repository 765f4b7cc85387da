"""Callbacks and rollouts that kill or signal the training process on purpose, for the crash, resume and stop tests.

They are added from the command line (`+callbacks.kill={_target_: fault_injection.KillAfterStep, step: 5}`)
with this folder on PYTHONPATH, so the run under test is the real CLI, killed as a crash would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import lightning as L

from lit_grpo.run.checkpoint import CheckpointStore


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: as a crash or an OOM kill


class KillAfterStep(L.Callback):
    """SIGKILL the process at the end of rollout step `step` (before that step's checkpoint, if any)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs:  # a trained step (empty when the stream ended)
            self.done += 1
            if self.done == self.step:
                _die()


class KillDuringSave(L.Callback):
    """SIGKILL the process while the checkpoint of `step` is being published: its shards and
    state files are written to the staging folder, the manifest and the rename are not done."""

    def __init__(self, step: int) -> None:
        original = CheckpointStore.publish

        def publish(store, at_step, staging, meta):
            if at_step == step:
                _die()
            return original(store, at_step, staging, meta)

        CheckpointStore.publish = publish


class DiskFullAtSave(L.Callback):
    """The disk is full when the checkpoint of `step` is written: its shards half written, then
    `No space left on device`."""

    def __init__(self, step: int) -> None:
        import errno

        import lit_grpo.run.state as run_state

        original = run_state.dcp.save

        def save(state_dict, *, checkpoint_id, **kwargs):
            if checkpoint_id.name.endswith(f"{step:08d}"):
                (checkpoint_id / "__0_0.distcp").write_bytes(b"half a shard")
                raise OSError(errno.ENOSPC, "No space left on device", str(checkpoint_id / "__0_0.distcp"))
            return original(state_dict, checkpoint_id=checkpoint_id, **kwargs)

        run_state.dcp.save = save


class ExportDiskFull(L.Callback):
    """The disk of `output_model_id` is full when the trained policy is exported (the rescue folder,
    in the run folder, is on another disk)."""

    def __init__(self, folder: str = "final_model") -> None:
        import errno

        import lit_grpo.callbacks.export as export

        original = export.export_pretrained

        def export_pretrained(model, tokenizer, out_dir, **kwargs):
            if out_dir.name == folder:
                raise OSError(errno.ENOSPC, "No space left on device", str(out_dir))
            return original(model, tokenizer, out_dir, **kwargs)

        export.export_pretrained = export_pretrained


class SignalAfterStep(L.Callback):
    """Send this process `signum` at the end of rollout step `step` (before the step sequence runs).
    With `linger_s`, keep the step busy that long, and with `again_after_s` send the signal again
    that many seconds into it (a slow step end that a second signal must cut short)."""

    def __init__(
        self, step: int, signum: int = signal.SIGTERM, linger_s: float = 0.0, again_after_s: float | None = None
    ) -> None:
        self.step, self.signum, self.linger_s, self.again_after_s = step, signum, linger_s, again_after_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs and pl_module.rollout_step == self.step:
            os.kill(os.getpid(), self.signum)
            if self.again_after_s is not None:
                threading.Timer(self.again_after_s, os.kill, (os.getpid(), self.signum)).start()
            time.sleep(self.linger_s)


def make_hanging_rollout_fn(setup):
    """The default rollout until call `hang_at_call` (extras), which never returns; `signal_after_s`
    later this process gets `signum` (extras, a name such as SIGTERM): a stop during a hung rollout."""
    from lit_grpo.rollouts.rollout import make_rollout_fn

    inner = make_rollout_fn(setup)
    hang_at = int(setup.extras["hang_at_call"])
    signum = getattr(signal, setup.extras.get("signal", "SIGTERM"))
    calls = {"n": 0}

    async def rollout_fn(row):
        calls["n"] += 1
        if calls["n"] == hang_at:
            threading.Timer(float(setup.extras.get("signal_after_s", 0.5)), os.kill, (os.getpid(), signum)).start()
            await asyncio.sleep(10**6)
        return await inner(row)

    return rollout_fn


def make_hanging_engine_rollout_fn(setup):
    """The default rollout on a sampler whose engine call number `hang_at_generate` (extras) never
    returns; `signal_after_s` later this process gets `signum`: a stop during a hung engine call."""
    from lit_grpo.rollouts.rollout import make_rollout_fn

    sampler = setup.sampler
    generate, hang_at = sampler._generate, int(setup.extras["hang_at_generate"])
    signum = getattr(signal, setup.extras.get("signal", "SIGTERM"))
    calls = {"n": 0}

    def hanging_generate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == hang_at:
            threading.Timer(float(setup.extras.get("signal_after_s", 0.5)), os.kill, (os.getpid(), signum)).start()
            time.sleep(10**6)
        return generate(*args, **kwargs)

    sampler._generate = hanging_generate
    return make_rollout_fn(setup)


def make_signalling_rollout_fn(setup):
    """The default rollout; call `signal_at_call` (extras) sends this process SIGINT from inside the
    rollout, so that the handler runs inside that rollout's asyncio task (not in the loop's wait)."""
    from lit_grpo.rollouts.rollout import make_rollout_fn

    inner, at, calls = make_rollout_fn(setup), int(setup.extras["signal_at_call"]), [0]

    async def rollout_fn(row):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at this task's next bytecode
        return await inner(row)

    return rollout_fn


def _kill_group(pgid: int) -> None:
    """SIGKILL a vLLM server's whole process group (the API server and its engine), as an OOM
    killer or a preempted node would end it, and wait until its port is closed."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(1.0)


class KillServerBeforeSync(L.Callback):
    """SIGKILL the server whose process group is `pgid` at the end of rollout step `step`, before
    the step sequence syncs the weights: that step's sync finds the server gone."""

    def __init__(self, step: int, pgid: int) -> None:
        self.step, self.pgid = step, pgid

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs and pl_module.rollout_step == self.step:
            _kill_group(self.pgid)


def make_server_killing_rollout_fn(setup):
    """The default rollout; at call `kill_at_call` (extras) the server whose process group is
    `kill_pgid` is SIGKILLed first: that call's request, and those after it, find it gone."""
    from lit_grpo.rollouts.rollout import make_rollout_fn

    inner = make_rollout_fn(setup)
    kill_at, pgid = int(setup.extras["kill_at_call"]), int(setup.extras["kill_pgid"])
    calls = {"n": 0}

    async def rollout_fn(row):
        calls["n"] += 1
        if calls["n"] == kill_at:
            _kill_group(pgid)
        return await inner(row)

    return rollout_fn


class FailSyncAtStep(L.Callback):
    """From rollout step `step` on, the sampler's weight sync raises the error a dead vLLM server
    gives (`WeightSyncError` naming `url`): a server lost during a sync, without starting one."""

    def __init__(self, step: int, url: str = "http://127.0.0.1:9") -> None:
        self.step, self.url = step, url

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lit_grpo.samplers.server.weight_files import WeightSyncError

        if outputs and pl_module.rollout_step == self.step:

            def dead(named_tensors):
                raise WeightSyncError(
                    f"weight sync to version {self.step + 1} failed on {self.url} (vLLM server "
                    f"{self.url}: POST /pause failed (ConnectError: connection refused))",
                    servers=[self.url],
                )

            trainer.datamodule.sampler.update_weights = dead


def make_server_error_rollout_fn(setup):
    """The default rollout until call `fail_at_call` (extras); from then on every call raises the
    error a vLLM server gone mid-sampling gives (`ServerError` naming `url`)."""
    from lit_grpo.rollouts.rollout import make_rollout_fn
    from lit_grpo.samplers.server.weight_files import ServerError

    inner = make_rollout_fn(setup)
    fail_at, url = int(setup.extras["fail_at_call"]), setup.extras.get("url", "http://127.0.0.1:9")
    calls = {"n": 0}

    async def rollout_fn(row):
        calls["n"] += 1
        if calls["n"] >= fail_at:
            raise ServerError(
                f"no vLLM server left: vLLM server {url}: "
                "POST /v1/completions failed (ConnectError: connection refused)"
            )
        return await inner(row)

    return rollout_fn
