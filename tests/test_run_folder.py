"""The output folder: one run at a time (a lock another process holds refuses a start, a killed
holder's lock does not), no fresh start on top of checkpoints, no resume=auto that starts over on
top of corrupt ones, no resume that mixes two runs, and an earlier run's metrics.csv kept."""

from __future__ import annotations

import csv
import os
import select
import signal
import subprocess
import sys

import pytest
from conftest import compose_config
from hydra.utils import instantiate
from test_checkpoint import REPO, RUN, TESTS, fake_checkpoint

from lit_grpo.config import ConfigError
from lit_grpo.run.folder import LOCK_FILE, claim_output_dir, find_resume_checkpoint, set_aside_metrics
from lit_grpo.train import train

HOLD_LOCK = (
    "import sys, time; from lit_grpo.run.folder import claim_output_dir; "
    "lock = claim_output_dir(sys.argv[1]); print('held', flush=True); time.sleep(300)"
)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model loads: every refusal here must come first."""
    import lit_grpo.build

    def load_policy(*args, **kwargs):
        raise AssertionError("a model was loaded before the output folder was checked")

    monkeypatch.setattr(lit_grpo.build, "load_policy", load_policy)


def test_a_fresh_run_in_a_folder_with_checkpoints_is_refused_before_a_model_loads(tmp_path, no_model):
    for step in (6, 8):
        fake_checkpoint(tmp_path / "checkpoints", step, "0123456789abcdef")
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as err:
        train(compose_config(*RUN, output_dir=tmp_path))
    message = str(err.value)
    for part in ("step_00000006, step_00000008 (run 01234567)", "resume=auto", "hydra.run.dir=", "output_dir="):
        assert part in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    # Only a save killed before it published is no checkpoint: a fresh start there goes ahead.
    (tmp_path / "other" / "checkpoints" / ".tmp-step_00000002").mkdir(parents=True)
    assert find_resume_checkpoint(None, tmp_path / "other") is None


def test_resume_auto_with_only_corrupt_checkpoints_refuses_naming_each_problem(tmp_path, no_model):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step, "r")
    (root / "step_00000002" / "config.yaml").write_text("torn")
    (root / "step_00000004" / "manifest.json").write_text("[]")
    (root / "step_00000006" / "manifest.json").unlink()
    with pytest.raises(ConfigError) as err:
        train(compose_config(*RUN, "resume=auto", output_dir=tmp_path))
    message = str(err.value)
    for problem in (
        "step_00000006: no manifest.json",
        "step_00000004: manifest.json holds a JSON array",
        "step_00000002: config.yaml has 4 bytes",
    ):
        assert problem in message
    assert "resume=<path>" in message and "hydra.run.dir=" in message
    assert not (tmp_path / "metrics.csv").exists()  # nothing started

    fake_checkpoint(root, 3, "r")
    assert find_resume_checkpoint("auto", tmp_path) == root / "step_00000003"  # one that verifies: resumed
    assert find_resume_checkpoint("auto", tmp_path / "empty") is None  # none at all: fresh


def test_resuming_into_a_folder_that_holds_another_history_is_refused(tmp_path):
    theirs = fake_checkpoint(tmp_path / "theirs" / "checkpoints", 4, "theirs")
    fake_checkpoint(tmp_path / "out" / "checkpoints", 2, "ours")
    ours = fake_checkpoint(tmp_path / "out" / "checkpoints", 6, "ours")
    with pytest.raises(ConfigError, match=r"step_00000002, step_00000006 \(run ours\).*Move those checkpoints away"):
        find_resume_checkpoint(str(theirs), tmp_path / "out")  # another run's history in the folder
    with pytest.raises(ConfigError, match=r"step_00000006 \(run ours\)"):
        find_resume_checkpoint(
            str(tmp_path / "out" / "checkpoints" / "step_00000002"), tmp_path / "out"
        )  # its later steps
    assert find_resume_checkpoint(str(ours), tmp_path / "out") == ours  # its newest: the same as resume=auto
    (ours / "config.yaml").write_text("torn")  # a broken later step of the same run is no other history
    step2 = tmp_path / "out" / "checkpoints" / "step_00000002"
    assert find_resume_checkpoint(str(step2), tmp_path / "out") == step2
    assert find_resume_checkpoint(str(theirs), tmp_path / "fresh") == theirs  # into an empty folder: a branch


def test_a_second_run_on_the_folder_is_refused_while_the_first_holds_it(tmp_path, no_model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 120)
        assert ready and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by another run: pid {holder.pid} on host"):
            claim_output_dir(tmp_path)
        with pytest.raises(ConfigError, match=rf"pid {holder.pid}"):
            train(compose_config(*RUN, "max_steps=2", output_dir=tmp_path))  # refused before a model loads
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup: its lock file stays, naming a dead pid
        holder.wait(timeout=30)
    assert str(holder.pid) in (tmp_path / LOCK_FILE).read_text()
    with claim_output_dir(tmp_path) as lock:  # the kernel dropped the killed holder's lock
        assert lock.held and f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()}"):
            claim_output_dir(tmp_path)  # a second claim, even from this process
    with claim_output_dir(tmp_path) as lock:  # released at the end of the `with`
        assert lock.held
    assert not (tmp_path / LOCK_FILE).exists()  # and its file removed


def test_the_lock_file_goes_when_a_run_ends_and_never_someone_elses(tmp_path):
    train(compose_config(*RUN, "max_steps=2", output_dir=tmp_path / "clean"))  # a clean run
    assert (tmp_path / "clean" / "summary.json").is_file() and not (tmp_path / "clean" / LOCK_FILE).exists()
    with pytest.raises(ConfigError, match="learning_rate"):
        train(compose_config(*RUN, "learning_rate=-1", output_dir=tmp_path / "refused"))  # refused before the claim
    fake_checkpoint(tmp_path / "held" / "checkpoints", 2, "earlier")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(compose_config(*RUN, "max_steps=2", output_dir=tmp_path / "held"))  # refused inside the claim
    assert not (tmp_path / "held" / LOCK_FILE).exists()

    lock = claim_output_dir(tmp_path / "taken")
    (tmp_path / "taken" / LOCK_FILE).unlink()  # removed under the holder (by hand): a new run may lock a new file
    with claim_output_dir(tmp_path / "taken") as theirs:
        lock.release()  # the first holder's release leaves the new holder's file alone
        assert theirs.held and f'"pid": {os.getpid()}' in (tmp_path / "taken" / LOCK_FILE).read_text()
    assert not (tmp_path / "taken" / LOCK_FILE).exists()


def test_other_ranks_neither_lock_nor_move_files(tmp_path, monkeypatch):
    (tmp_path / "metrics.csv").write_text("step\n0\n")
    with claim_output_dir(tmp_path):
        monkeypatch.setenv("LOCAL_RANK", "1")  # a process that Lightning's launcher started for rank 1
        assert not claim_output_dir(tmp_path).held  # it runs inside rank 0's claim
        assert set_aside_metrics(tmp_path, None) is None
    assert (tmp_path / "metrics.csv").exists()


def test_a_fresh_run_keeps_the_metrics_of_an_earlier_run(tmp_path):
    earlier = "reward/mean,step\n0.25,0\n0.5,1\n"
    (tmp_path / "metrics.csv").write_text(earlier)
    os.utime(tmp_path / "metrics.csv", (1.7e9, 1.7e9))  # 2023-11-14, when that run last wrote
    train(compose_config(*RUN, "max_steps=2", output_dir=tmp_path))
    kept = list(tmp_path.glob("metrics.2023111*.csv"))
    assert len(kept) == 1 and kept[0].read_text() == earlier
    assert [row["step"] for row in csv.DictReader((tmp_path / "metrics.csv").open())] == ["0", "1"]  # this run's

    (tmp_path / "metrics.csv").write_text(earlier)
    os.utime(tmp_path / "metrics.csv", (1.7e9, 1.7e9))
    assert set_aside_metrics(tmp_path, None).name == kept[0].name.replace(".csv", "-1.csv")  # never over another
    (tmp_path / "metrics.csv").write_text(earlier)
    # Resuming this folder's own run: metrics.csv is its own, rewritten from the checkpoint's history.
    assert set_aside_metrics(tmp_path, tmp_path / "checkpoints" / "step_00000002") is None
    assert set_aside_metrics(tmp_path, tmp_path / "elsewhere" / "checkpoints" / "step_00000002") is not None


def test_the_csv_logger_writes_each_step_when_it_is_logged(tmp_path):
    logger = instantiate(compose_config(output_dir=tmp_path).logger.csv)
    for step in range(3):
        logger.log_metrics({"reward/mean": 0.5 * step, "train/loss": 1.0}, step=step)
        rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
        assert [row["step"] for row in rows] == [str(s) for s in range(step + 1)]  # on disk, no save() needed


def test_a_resume_that_fails_before_it_goes_on_leaves_metrics_csv_as_it_was(tmp_path, monkeypatch):
    """Lightning's CSV writer deletes metrics.csv when it starts; a resume that then fails (here the
    resume's weight sync, as a server refusing it would) must not take the run's curve with it. The
    first save after the resume has gone through replaces the file whole."""
    from lit_grpo.errors import EnvironmentFault
    from lit_grpo.loop.step_sequence import StepSequence

    train(compose_config(*RUN, "max_steps=4", output_dir=tmp_path))
    before = (tmp_path / "metrics.csv").read_bytes()
    assert before.count(b"\n") > 4

    def refused(self, module, version):
        raise EnvironmentFault("the sampler refused the resumed weights")

    with monkeypatch.context() as patch:
        patch.setattr(StepSequence, "sync_sampler", refused)
        with pytest.raises(EnvironmentFault):
            train(compose_config(*RUN, "max_steps=6", "resume=auto", output_dir=tmp_path))
    assert (tmp_path / "metrics.csv").read_bytes() == before
    assert not list(tmp_path.glob(".metrics.csv.*"))

    train(compose_config(*RUN, "max_steps=6", "resume=auto", output_dir=tmp_path))
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert sorted({int(r["step"]) for r in rows if r.get("reward/mean")}) == list(range(6))
