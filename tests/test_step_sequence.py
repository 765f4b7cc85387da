"""The step sequence owns the policy version: training advances with every optional callback
dropped, in every scheduling mode, and the sampler holds exactly the weights of the last due sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose_config

from lit_grpo.build import build_run
from lit_grpo.run.validate import validate

REPO = Path(__file__).resolve().parents[1]
NO_EXTRAS = [
    "callbacks=none",
    "max_steps=3",
    "task.num_rows=64",
    "logger=none",
    "output_model_id=null",
    "trainer.enable_progress_bar=false",
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "sweep",
    [
        ["offpolicy.synchronous=true", "offpolicy.weight_sync_interval=0,1,2"],
        ["offpolicy.synchronous=false", "offpolicy.max_lag=0", "offpolicy.weight_sync_interval=0,1"],
        ["offpolicy.synchronous=false", "offpolicy.max_lag=1,2", "offpolicy.weight_sync_interval=0,1,2"],
    ],
    ids=["sync", "async-O0", "async-O1-O2"],
)
@pytest.mark.slow
def test_every_mode_finishes_with_no_callbacks(sweep, tmp_path):
    """`callbacks=none` used to hang at step 2: the version only moved in a droppable callback."""
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "-m", *NO_EXTRAS, *sweep, f"hydra.sweep.dir={tmp_path}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("*/summary.json")]
    jobs = 1
    for override in sweep:
        jobs *= len(override.split("=", 1)[1].split(","))
    assert len(summaries) == jobs
    assert all(s["steps"] == 3 for s in summaries), [(s["overrides"], s["steps"]) for s in summaries]


class WeightLog(L.Callback):
    """After k steps (before step k + 1, and at the end): the policy's weights and the sampler's."""

    def __init__(self) -> None:
        self.policy: dict[int, dict[str, torch.Tensor]] = {}
        self.sampler: dict[int, dict[str, torch.Tensor]] = {}

    def _snap(self, trainer, pl_module) -> None:
        k = pl_module.rollout_step
        self.policy[k] = {name: v.detach().clone() for name, v in pl_module.policy.state_dict().items()}
        self.sampler[k] = {
            name: v.detach().clone() for name, v in trainer.datamodule.sampler.model.state_dict().items()
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._snap(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._snap(trainer, pl_module)


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("interval", [1, 2, 0])
def test_sampler_holds_the_policy_exactly_when_a_sync_was_due(interval, tmp_path):
    steps = 5
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            f"max_steps={steps}",
            f"offpolicy.weight_sync_interval={interval}",
            "offpolicy.synchronous=true",  # the reward filter on: every step has a signal, so every step moves
            "learning_rate=0.01",
            "optim.lr_decay=constant",
            "logger=none",
            "output_model_id=null",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    weights = WeightLog()
    trainer, module, datamodule = build_run(c, extra_callbacks=[weights])
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.close()
    assert sorted(weights.policy) == list(range(steps + 1))
    versions = []
    for k in range(steps + 1):  # after k steps
        if k:
            assert not _equal(weights.policy[k], weights.policy[k - 1]), f"step {k} left the policy unchanged"
        last_sync = k - k % interval if interval else 0
        assert _equal(weights.sampler[k], weights.policy[last_sync]), (
            f"after {k} steps the sampler should hold the policy of step {last_sync}"
        )
        if last_sync != k:
            assert not _equal(weights.sampler[k], weights.policy[k])
        versions.append(k // interval if interval else k)
    # The version advances with each sync (every step for interval 0); logged is the version a step trained at.
    assert module.step_sequence.history.series("policy/version") == [float(v) for v in versions[:-1]]
    assert datamodule.version == versions[-1]


def test_build_run_hands_the_module_the_step_sequence_of_its_data(tmp_path):
    # The step sequence owns the version: the module gets it from build_run (no fallback built
    # behind the caller's back), and it drives the run's own data module.
    c = validate(
        compose_config(
            *NO_EXTRAS[:3],
            "offpolicy.synchronous=false",
            "logger=none",
            "output_model_id=null",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    trainer, module, datamodule = build_run(c)
    try:
        assert module.step_sequence is not None and module.step_sequence.datamodule is datamodule
        trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.close()
    assert module.rollout_step == 3 and datamodule.version == 3
