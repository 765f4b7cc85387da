"""DCP checkpoints: an exact resume after SIGKILL, a kill during a save, corrupt checkpoints,
pruning that touches only its own run's checkpoints, the config-mismatch refusal, and the Hugging
Face export (end of fit and `python -m lit_grpo.run.export`)."""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from safetensors.torch import load_file

from lit_grpo.config import ConfigError
from lit_grpo.rollouts import GroupSampler, OffPolicyScheduler, RowCursor
from lit_grpo.rollouts.datamodule import RolloutStream
from lit_grpo.run.checkpoint import CheckpointStore, check_resumable, locate_checkpoint, run_id_of, verify
from lit_grpo.run.validate import validate
from lit_grpo.train import train
from lit_grpo.types import RolloutSample

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
STEPS, EVERY = 8, 2
# Synchronous, so a run is a deterministic function of its seed; the tiny model, 8 steps.
RUN = [
    "+experiment=arithmetic",
    f"max_steps={STEPS}",
    f"checkpoint.save_interval={EVERY}",
    "trainer.enable_progress_bar=false",
]


def run_cli(
    run_dir: Path, *overrides: str, module: str = "lit_grpo.train", base: Sequence[str] = RUN
) -> subprocess.CompletedProcess:
    """`python -m module` in a fresh process: for `lit_grpo.train`, `base` (this file's run) then
    `overrides`, in `run_dir`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    args = [*base, *overrides, f"hydra.run.dir={run_dir}"] if module == "lit_grpo.train" else list(overrides)
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600
    )


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs: max abs diff {(a[name] - b[name]).abs().max().item()}"


def csv_rewards(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): float(r["reward/mean"]) for r in rows if r.get("reward/mean")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = run_cli(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def fake_checkpoint(root: Path, step: int, run_id: str, keep_last: int = 100) -> Path:
    """A small checkpoint of run `run_id` published through the real store (placeholder shards)."""
    store = CheckpointStore(root, keep_last=keep_last, run_id=run_id)
    staging = store.begin(step)
    for name in (".metadata", "config.yaml", "trainer_state_rank0.pt"):
        (staging / name).write_text(f"{name} of {run_id} at step {step}")
    return store.publish(step, staging, {})


def test_checkpoints_are_published_whole_and_pruned(uninterrupted):
    store = CheckpointStore(uninterrupted / "checkpoints")
    # dcp_keep_last=2 of the saves at steps 2, 4, 6, 8; no staging folder left behind.
    assert [step for step, _ in store.step_dirs()] == [6, 8]
    assert not list(store.root.glob(".tmp-*"))
    for _, path in store.step_dirs():
        assert verify(path) is None
        assert {".metadata", "config.yaml", "manifest.json", "trainer_state_rank0.pt"} <= {
            p.name for p in path.iterdir()
        }
    # Both name the run that wrote them, in the manifest and in the trainer state.
    run_ids = {run_id_of(path) for _, path in store.step_dirs()}
    assert len(run_ids) == 1 and len(run_ids.pop()) == 32
    state = torch.load(store.root / "step_00000008" / "trainer_state_rank0.pt", weights_only=False)
    assert state["run_id"] == run_id_of(store.root / "step_00000008")


def test_resume_after_sigkill_is_exact(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    killed = run_cli(run_dir, "+callbacks.kill={_target_:fault_injection.KillAfterStep,step:5}")
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL, after the step-4 checkpoint
    assert not (run_dir / "final_model").exists()

    run_id = run_id_of(run_dir / "checkpoints" / "step_00000004")
    resumed = run_cli(run_dir, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_00000004")
    assert summary["steps"] == STEPS
    # The resumed run kept the killed run's id, so it pruned that run's steps 2 and 4 as its own.
    store = CheckpointStore(run_dir / "checkpoints")
    assert [(step, run_id_of(path)) for step, path in store.step_dirs()] == [(6, run_id), (8, run_id)]

    assert_bit_identical(tensors(uninterrupted / "final_model"), tensors(run_dir / "final_model"))
    expected = json.loads((uninterrupted / "summary.json").read_text())["reward_curve"]
    assert summary["reward_curve"] == expected  # steps 5..8 sampled again, identically
    assert csv_rewards(run_dir) == csv_rewards(uninterrupted)  # metrics.csv covers the whole run
    assert len(csv_rewards(run_dir)) == STEPS


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    killed = run_cli(run_dir, "+callbacks.kill={_target_:fault_injection.KillDuringSave,step:4}")
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step_00000004", "step_00000002"]
    assert (checkpoints / ".tmp-step_00000004" / "__0_0.distcp").exists()  # the shards were written

    resumed = run_cli(run_dir, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"].endswith("step_00000002")
    assert_bit_identical(tensors(uninterrupted / "final_model"), tensors(run_dir / "final_model"))
    assert not list(checkpoints.glob(".tmp-*"))  # the abandoned staging folder is cleaned up


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_used(uninterrupted, tmp_path, caplog):
    root = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", root)
    shard = root / "step_00000008" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # a torn copy
    with caplog.at_level(logging.WARNING):
        assert locate_checkpoint(root) == root / "step_00000006"
    assert "step_00000008" in caplog.text and "__0_0.distcp" in caplog.text

    with pytest.raises(ValueError, match="__0_0.distcp has 1000 bytes"):
        locate_checkpoint(root / "step_00000008")  # named explicitly: refused, not silently replaced

    flipped = root / "step_00000006" / "trainer_state_rank0.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    flipped.write_bytes(bytes(data))
    assert "sha256" in verify(root / "step_00000006")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        locate_checkpoint(root)

    (root / "step_00000004").mkdir()  # a folder with a checkpoint's name but no manifest
    assert "no manifest" in verify(root / "step_00000004")


def test_pruning_deletes_only_this_runs_verified_checkpoints(tmp_path, caplog):
    """The issue's case: a new run in a folder that holds an older, longer run's checkpoints must
    not delete its own checkpoints (they are not the highest steps), nor the older run's."""
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        fake_checkpoint(root, step, "older")
    (root / "step_00000030" / "config.yaml").write_text("torn")  # the older run's, corrupt
    (root / "step_00000040").mkdir()  # nobody's: no manifest
    CheckpointStore(root, run_id="older").begin(50)  # the older run's save, killed
    ours = CheckpointStore(root, keep_last=2, run_id="new")
    (ours.begin(9) / "__0_0.distcp").write_text("a save of ours that was killed")
    foreign = {"step_00000010", "step_00000020", "step_00000030", "step_00000040", ".tmp-step_00000050"}

    def names() -> set[str]:
        return {p.name for p in root.iterdir()}

    for step in (1, 2, 3):
        staging = ours.begin(step)
        for name in (".metadata", "config.yaml", "trainer_state_rank0.pt"):
            (staging / name).write_text(f"{name} {step}")
        ours.publish(step, staging, {})
        ours.prune()
    assert names() == foreign | {"step_00000002", "step_00000003"}  # our staging .tmp-step_00000009 is cleaned
    assert run_id_of(root / "step_00000003") == "new" and verify(root / "step_00000010") is None

    # After a restart (a new store of the same run): our newest is corrupt, so it does not count
    # towards keep_last and is left in place; step 2 is now the newest verified one and stays.
    (root / "step_00000003" / ".metadata").write_text("torn")
    resumed = CheckpointStore(root, keep_last=2, run_id="new")
    with caplog.at_level(logging.WARNING):
        resumed.prune()
    assert names() == foreign | {"step_00000002", "step_00000003"}
    assert "step_00000003" in caplog.text and "does not verify" in caplog.text
    for step in (4, 5):
        fake_checkpoint(root, step, "new")
        resumed.prune()
    assert names() == foreign | {"step_00000003", "step_00000004", "step_00000005"}

    # Publishing over a folder at our step that another run wrote moves it aside, never deletes it.
    fake_checkpoint(root, 20, "new")
    assert run_id_of(root / "step_00000020") == "new"
    displaced = [p for p in root.iterdir() if p.name.startswith("step_00000020.displaced-")]
    assert len(displaced) == 1 and run_id_of(displaced[0]) == "older"


@pytest.mark.parametrize(
    "manifest, reason",
    [
        ("[1, 2]", "holds a JSON array, not an object"),
        ('"files"', "holds a JSON string, not an object"),
        ("null", "holds a JSON null, not an object"),
        ("{}", "no `files` object"),
        ('{"files": ["config.yaml"]}', "no `files` object"),
        (
            '{"files": {".metadata": 5, "config.yaml": 5, "trainer_state_rank0.pt": 5}}',
            "entry for .metadata is not {bytes, sha256}",
        ),
        (
            '{"files": {"../x": {}, ".metadata": {}, "config.yaml": {}, "trainer_state_rank0.pt": {}}}',
            "outside the checkpoint",
        ),
        ("{not json", "unreadable manifest.json"),
    ],
)
def test_a_manifest_that_is_not_an_object_is_corrupt_not_a_crash(tmp_path, manifest, reason):
    path = fake_checkpoint(tmp_path / "checkpoints", 2, "r")
    (path / "manifest.json").write_text(manifest)
    assert reason in verify(path)
    assert run_id_of(path) is None
    with pytest.raises(ValueError, match="cannot be used"):
        locate_checkpoint(path)
    assert CheckpointStore(tmp_path / "checkpoints").newest_complete() is None


def test_resuming_with_a_config_that_changes_the_state_is_refused(uninterrupted, tmp_path, monkeypatch):
    import lit_grpo.build

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(lit_grpo.build, "load_policy", no_model)
    cfg = compose_config(
        *RUN,
        "policy_loss=dapo",
        "data.completions_per_prompt=4",
        "model.hidden_size=32",
        f"resume={uninterrupted / 'checkpoints'}",
        output_dir=tmp_path,
    )
    with pytest.raises(ConfigError) as err:
        train(cfg)
    message = str(err.value)
    for field in (
        "policy_loss.name: 'grpo' in the checkpoint, 'dapo' now",
        "data.completions_per_prompt: 8 in the checkpoint, 4 now",
        "model.hidden_size",
    ):
        assert field in message
    assert "learning_rate" not in message

    # More steps, another logger, another output folder: allowed.
    check_resumable(
        uninterrupted / "checkpoints" / "step_00000008",
        validate(compose_config(*RUN, "max_steps=20", "logger=none", output_dir=tmp_path)),
    )


def test_resume_auto_without_a_checkpoint_starts_fresh_and_a_bad_path_is_an_error(tmp_path):
    summary = train(compose_config(*RUN, "max_steps=2", "resume=auto", output_dir=tmp_path))
    assert summary["steps"] == 2
    with pytest.raises(ConfigError, match="resume.*does not exist"):
        train(compose_config(*RUN, f"resume={tmp_path / 'nowhere'}", output_dir=tmp_path / "other"))


def test_export_cli_writes_a_model_that_loads_and_generates(uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    proc = run_cli(tmp_path, str(uninterrupted), str(out), module="lit_grpo.export")  # the public entry point
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The newest checkpoint (step 8) is the end of training: the same tensors as the end-of-fit export.
    assert_bit_identical(tensors(uninterrupted / "final_model"), tensors(out))

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("3+4=", return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(generated[0]), str)

    again = run_cli(tmp_path, str(uninterrupted), str(out), module="lit_grpo.run.export")
    assert again.returncode == 2 and "--force" in again.stderr  # an existing folder is not overwritten silently


def _row_fn():
    async def rollout_fn(row):
        await asyncio.sleep(0.002 * (row["id"] % 3))  # uneven latency: rows finish out of order
        # The row's id rides in the tokens, so a batch tells which rows it trains.
        return RolloutSample(
            tokens=[1, 100 + row["id"], 2], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1], reward=float(row["id"] % 2)
        )

    return rollout_fn


def trained_ids(batch, group_size: int) -> list[int]:
    return [int(t) - 100 for t in batch.tokens_BT[::group_size, 1]]


def test_off_policy_scheduler_state_loses_no_row_and_repeats_none():
    """Rows in flight or queued at a checkpoint are sampled again after resume; trained ones are not."""
    rows = [{"id": i} for i in range(40)]
    G, P = 2, 2

    def scheduler():
        groups = GroupSampler(_row_fn(), G, max_seq_len=64, min_group_size=2, filters=[])
        scheduler = OffPolicyScheduler(
            RowCursor(rows, 1, 0, True), groups, P, max_head_offpolicy_versions=2, max_concurrency=64
        )
        return scheduler, iter(RolloutStream(scheduler, groups, max_steps=-1, pad_id=0))

    first, stream = scheduler()
    before = []
    for _ in range(3):
        before += trained_ids(next(stream), G)
        first.advance_version()
    state = first.state_dict()
    first.close()
    assert state["cursor"]["replay"], "with O=2 some rows are still in flight or queued at the checkpoint"
    assert state["trained_samples"] == 3 * P * G and state["version"] == 3

    second, stream = scheduler()
    second.load_state_dict(state)
    assert second.accepted_samples == 3 * P * G  # the gate resumes as if only trained rows were accepted
    after = []
    for batch in stream:
        after += trained_ids(batch, G)
        second.advance_version()
    second.close()
    assert sorted(before + after) == list(range(40))  # every row trained exactly once across the restart


@pytest.mark.slow
def test_an_async_run_resumes_after_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    async_run = ["offpolicy.synchronous=false", "offpolicy.max_lag=1"]
    killed = run_cli(run_dir, *async_run, "+callbacks.kill={_target_:fault_injection.KillAfterStep,step:5}")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_cli(run_dir, *async_run, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_00000004") and summary["steps"] == STEPS
    assert (run_dir / "final_model" / "model.safetensors").exists()


def test_export_merges_a_lora_policy(tiny_model, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lit_grpo.run.export import export_pretrained

    policy = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # LoRA starts as a no-op (B = 0); make it change the outputs
    tokens = torch.tensor([[5, 17, 23, 42, 8]])
    with torch.no_grad():
        expected = policy(input_ids=tokens).logits
        with policy.disable_adapter():
            base = policy(input_ids=tokens).logits
    assert not torch.allclose(expected, base, atol=1e-4)

    out = export_pretrained(policy, tokenizer, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name in loaded.state_dict())  # a plain model, adapters merged in
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, expected, atol=1e-5, rtol=1e-5)
    assert any("lora_A" in name for name, _ in policy.named_parameters())  # the training policy is untouched


def test_a_checkpoint_saved_before_a_field_existed_resumes_when_the_field_is_at_its_default(tmp_path):
    from omegaconf import OmegaConf

    from lit_grpo.run.checkpoint import CONFIG_FILE, config_as_dict

    c = validate(compose_config("+experiment=arithmetic", output_dir=tmp_path))
    older = config_as_dict(c)
    del older["data"]["path"], older["data"]["prompt_field"]  # fields this checkpoint's version did not have
    OmegaConf.save(OmegaConf.create(older), tmp_path / CONFIG_FILE)
    check_resumable(tmp_path, c)
    changed = validate(compose_config("+experiment=arithmetic", "data.path=rows.jsonl", output_dir=tmp_path))
    with pytest.raises(ConfigError, match="data.path"):
        check_resumable(tmp_path, changed)


# 16 rows, 2 groups a step, no filter: an epoch is exactly 8 steps, and step 8's checkpoint is the
# end of the first epoch (verl #7401: a resume from there trained 0 steps and exited 0).
EPOCH_RUN = [
    "+experiment=arithmetic",
    "task.num_rows=16",
    "data.prompt_groups_per_step=2",
    "data.epochs=2",
    "max_steps=12",
    "checkpoint.save_interval=8",
    "~callbacks.reward_filter",
    "trainer.enable_progress_bar=false",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_resume_from_the_checkpoint_at_an_epoch_end_trains_on_to_max_steps(tmp_path):
    def cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
        return subprocess.run(
            [sys.executable, "-m", "lit_grpo.train", *EPOCH_RUN, *overrides, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    whole = tmp_path / "whole"
    assert (done := cli(whole)).returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    killed = cli(run_dir, "+callbacks.kill={_target_:fault_injection.KillAfterStep,step:9}")
    assert killed.returncode == -9, killed.stderr[
        -3000:
    ]  # SIGKILL in step 9: the last checkpoint is step 8's, the epoch's end
    state = torch.load(run_dir / "checkpoints" / "step_00000008" / "trainer_state_rank0.pt", weights_only=False)
    assert state["step"] == 8 and state["datamodule"]["steps_done"] == 8
    cursor = state["datamodule"]["scheduler"]["cursor"]
    assert (cursor["epoch"], cursor["index"], cursor["replay"]) in ((0, 16, []), (1, 0, [])), (
        cursor
    )  # every row of epoch 0 used

    resumed = cli(run_dir, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_00000008")
    assert summary["steps"] == 12 and "rows_exhausted" not in summary, summary  # 4 more steps, in the second epoch
    assert summary["stop_reason"] == "stopped: max_steps=12 reached"
    assert summary["reward_curve"] == json.loads((whole / "summary.json").read_text())["reward_curve"]
    assert_bit_identical(tensors(whole / "final_model"), tensors(run_dir / "final_model"))


class _OpensAFile:
    """Unpickling this creates `path`: what a hostile checkpoint could do with pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_refuses_a_trainer_state_that_needs_unpickling_without_running_it(tmp_path):
    """A checkpoint handed over by someone else: its trainer state carries one more entry whose
    unpickling opens a file, and its manifest is rewritten to match (whoever hands over a folder
    controls its manifest). Resuming from it is refused with one message, exit code 2, and the
    file is never created."""
    from lit_grpo.run.checkpoint import MANIFEST, read_manifest, write_manifest

    run_dir = tmp_path / "run"
    first = run_cli(run_dir, "max_steps=2", "output_model_id=null")
    assert first.returncode == 0, first.stderr[-3000:]
    folder = run_dir / "checkpoints" / "step_00000002"
    state_file = folder / "trainer_state_rank0.pt"
    state = torch.load(state_file, weights_only=True)  # what lit_grpo writes loads without unpickling objects
    marker = tmp_path / "pwned"
    state["extra"] = _OpensAFile(str(marker))
    torch.save(state, state_file)
    manifest, _ = read_manifest(folder)
    (folder / MANIFEST).unlink()
    write_manifest(folder, {k: v for k, v in manifest.items() if k != "files"})
    resumed = run_cli(run_dir, "max_steps=4", "output_model_id=null", "resume=auto")
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert not marker.exists()
    assert "trainer_state_rank0.pt holds objects other than tensors and plain values" in resumed.stderr
    assert "Traceback" not in resumed.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_at_a_checkpoint_stops_with_one_message_and_keeps_the_earlier_ones(tmp_path):
    run_dir = tmp_path / "run"
    full = run_cli(run_dir, "output_model_id=null", "+callbacks.disk={_target_:fault_injection.DiskFullAtSave,step:4}")
    assert full.returncode == 2, full.stderr[-3000:]
    message = full.stderr
    assert "step_00000004 could not be written (No space left on device" in message and "MiB free" in message
    assert "the earlier checkpoints are kept (step_00000002)" in message and "Traceback" not in message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.endswith(".txt")) == [
        "step_00000002"
    ]  # no partial folder left
    resumed = run_cli(run_dir, "output_model_id=null", "resume=auto", "max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_with_nothing_left_to_train_says_so(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, "max_steps=2", "output_model_id=null").returncode == 0
    again = run_cli(run_dir, "max_steps=2", "output_model_id=null", "resume=auto")
    assert again.returncode == 0 and "there is nothing left to train, no step will run" in again.stdout + again.stderr


def test_a_step_folder_without_a_manifest_says_what_it_holds(tmp_path):
    """Saves are published whole, so a missing manifest is never "a save that did not finish": a
    checkpoint's files without one are an older lit_grpo's (or a copy without it); else not a checkpoint."""
    old = tmp_path / "step_00000002"
    old.mkdir()
    (old / ".metadata").write_bytes(b"dcp")
    (old / "trainer_state_rank0.pt").write_bytes(b"state")
    assert "from before checkpoint manifests" in verify(old)
    empty = tmp_path / "step_00000004"
    empty.mkdir()
    assert "not a checkpoint lit_grpo wrote" in verify(empty)
    for problem in (verify(old), verify(empty)):
        assert "did not finish" not in problem.split("(or a copy")[0]


def test_a_short_write_reads_as_a_full_disk():
    """torch's writer on a full disk says `unexpected pos 704 vs 598` and no errno; DCP wraps each
    rank's error. The reason a user reads is the disk, with torch's words kept in brackets."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lit_grpo.run.state import is_short_write, write_failure_reason

    torch_says = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("save failed", {0: (torch_says, None)})
    for err in (torch_says, wrapped):
        assert is_short_write(err)
        assert write_failure_reason(err).startswith("No space left on device")
        assert "unexpected pos 704 vs 598" in write_failure_reason(err)
    try:
        raise RuntimeError("writing the state failed") from OSError(28, "No space left on device", "/ckpt/x")
    except RuntimeError as err:
        assert write_failure_reason(err) == "No space left on device: /ckpt/x"
    assert not is_short_write(RuntimeError("shape mismatch"))  # a bug is not the disk


def test_torch_failing_a_write_at_a_checkpoint_stops_with_the_disk_named(tmp_path, monkeypatch):
    """The trainer state's `torch.save` on a full disk raised a RuntimeError that escaped as a bug's
    traceback; now it is the checkpoint's one message, naming the disk, and the earlier checkpoint kept."""
    import lit_grpo.run.state as run_state

    original = run_state.torch.save

    def save(obj, f, *args, **kwargs):
        if "step_00000004" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(run_state.torch, "save", save)
    with pytest.raises(run_state.CheckpointWriteError) as caught:
        train(compose_config(*RUN, "max_steps=4", "output_model_id=null", output_dir=tmp_path))
    message = str(caught.value)
    assert "step_00000004 could not be written (No space left on device" in message and "MiB free" in message
    assert "step_00000002" in message
