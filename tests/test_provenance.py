"""Provenance: a run folder says what the run ran on (versions, commit, resolved config), written at
the start; its checkpoints carry the versions, and a resume under other versions says which, once."""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.config import UserInputs
from lit_grpo.run.checkpoint import CheckpointStore
from lit_grpo.run.provenance import PROVENANCE_FILE, git_commit, run_versions, version_changes
from lit_grpo.train import train

RUN = ["+experiment=arithmetic", "trainer.enable_progress_bar=false", "optim.lr_decay=constant"]


def test_versions_name_python_the_libraries_and_lit_grpo():
    versions = run_versions("hf")
    assert versions["python"] == platform.python_version()
    assert {"torch", "transformers", "lightning", "lit_grpo", "lit_grpo_commit"} <= versions.keys()
    assert all(versions[name] for name in ("torch", "transformers", "lightning", "lit_grpo"))
    assert "vllm" not in versions  # recorded when the sampler uses it
    assert "vllm" in run_versions("vllm") and "vllm" in run_versions("vllm_server")
    commit = git_commit()  # this checkout's HEAD (None outside a git checkout)
    assert commit is None or len(commit) == 40
    assert version_changes({"torch": "1.0", "python": versions["python"], "gone": "x"}, versions) == [
        f"torch 1.0 -> {versions['torch']}"
    ]


@pytest.mark.timeout(300)
def test_the_run_folder_and_its_checkpoints_record_the_versions_and_the_config(tmp_path):
    train(compose_config(*RUN, "max_steps=2", "checkpoint.save_interval=2", output_dir=tmp_path))
    record = json.loads((tmp_path / PROVENANCE_FILE).read_text())
    assert record["versions"] == run_versions("hf")
    assert record["config"]["max_steps"] == 2 and record["config"]["sampler"]["kind"] == "hf"
    assert record["resumed_from"] is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["versions"] == record["versions"] and summary["stop_reason"] == "stopped: max_steps=2 reached"
    ((_, checkpoint),) = CheckpointStore(tmp_path / "checkpoints").step_dirs()
    assert json.loads((checkpoint / "manifest.json").read_text())["versions"] == record["versions"]


@pytest.mark.timeout(300)
def test_a_crashed_run_has_its_provenance(tmp_path):
    def broken_reward(completion: str, row: dict) -> float:
        raise ZeroDivisionError("a bug in the reward")

    with pytest.raises(ZeroDivisionError):
        train(compose_config(*RUN, "max_steps=2", output_dir=tmp_path), UserInputs(reward_fn=broken_reward))
    assert not (tmp_path / "summary.json").exists()
    assert json.loads((tmp_path / PROVENANCE_FILE).read_text())["versions"]["torch"]


@pytest.mark.timeout(300)
def test_a_resume_under_other_versions_names_them_once(tmp_path, caplog):
    train(compose_config(*RUN, "max_steps=2", "checkpoint.save_interval=2", output_dir=tmp_path))
    ((_, checkpoint),) = CheckpointStore(tmp_path / "checkpoints").step_dirs()
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())  # the manifest's `versions` are not hashed: it stays valid
    manifest["versions"]["torch"] = "1.13.0"
    manifest["versions"]["lit_grpo_commit"] = "0" * 40
    manifest_path.write_text(json.dumps(manifest))

    with caplog.at_level(logging.WARNING):
        summary = train(
            compose_config(*RUN, "max_steps=3", "checkpoint.save_interval=2", "resume=auto", output_dir=tmp_path)
        )
    assert summary["steps"] == 3
    warnings = [r.getMessage() for r in caplog.records if "other versions" in r.getMessage()]
    assert len(warnings) == 1, warnings
    now = run_versions("hf")
    assert f"torch 1.13.0 -> {now['torch']}" in warnings[0]
    assert f"lit_grpo_commit {'0' * 40} -> {now['lit_grpo_commit']}" in warnings[0]
    assert "transformers" not in warnings[0] and "python" not in warnings[0]  # only what differs
    record = json.loads((tmp_path / PROVENANCE_FILE).read_text())
    assert Path(record["resumed_from"]) == checkpoint


@pytest.mark.timeout(300)
def test_a_resume_under_the_same_versions_says_nothing(tmp_path, caplog):
    train(compose_config(*RUN, "max_steps=2", "checkpoint.save_interval=2", output_dir=tmp_path))
    with caplog.at_level(logging.WARNING):
        train(compose_config(*RUN, "max_steps=3", "checkpoint.save_interval=2", "resume=auto", output_dir=tmp_path))
    assert not [r for r in caplog.records if "other versions" in r.getMessage()]
