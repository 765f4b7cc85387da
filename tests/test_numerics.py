"""A non-finite loss or gradient skips the update and is counted, and leaves the learning-rate
schedule where it was; several in a row stop the run with a clear error; non-finite weights are
never checkpointed."""

from __future__ import annotations

import warnings

import pytest
import torch
import user_losses
from conftest import compose_config

from lit_grpo.build import build_run
from lit_grpo.loop.step_sequence import NonFiniteTraining
from lit_grpo.run.validate import validate

RUN = [
    "+experiment=arithmetic",
    "policy_loss=user",
    "policy_loss.name=user_losses:nan_on_calls",
    "~callbacks.reward_filter",
    "optim.lr_decay=constant",
    "logger=none",
    "output_model_id=null",
    "trainer.enable_progress_bar=false",
]


def _fit(tmp_path, *overrides):
    c = validate(compose_config(*RUN, *overrides, output_dir=tmp_path))
    trainer, module, datamodule = build_run(c)
    before = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.close()
    return module, before


@pytest.mark.timeout(300)
def test_one_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(user_losses, "NAN_ON_CALLS", {2})  # one micro-batch per step: call 2 is step 2
    module, _ = _fit(tmp_path, "max_steps=4")
    skipped = module.step_sequence.history.series("train/skipped_nonfinite")
    assert skipped == [0.0, 1.0, 0.0, 0.0]
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    assert module.rollout_step == 4


@pytest.mark.timeout(300)
def test_a_skipped_step_leaves_the_learning_rate_where_it_was(tmp_path, monkeypatch):
    # Warm-up over 3 updates: the multiplier after n updates is (n + 1) / 4. The first step is
    # non-finite, so its update and the schedule's step are both skipped: no update was made at the
    # warm-up's first learning rate, and no torch warning that the schedule stepped before the optimizer.
    monkeypatch.setattr(user_losses, "NAN_ON_CALLS", {1})
    monkeypatch.setattr(user_losses, "_calls", {"n": 0})  # counted from this run's first call
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        module, _ = _fit(tmp_path, "max_steps=3", "optim.warmup_steps=3", "learning_rate=1e-3")
    history = module.step_sequence.history
    assert history.series("train/skipped_nonfinite") == [1.0, 0.0, 0.0]
    # A later step may be skipped too, for want of signal (no reward filter here): it leaves the rate as well.
    skipped = [
        a + b for a, b in zip(history.series("train/skipped_nonfinite"), history.series("train/skipped_no_signal"))
    ]
    updates = [sum(1 - s for s in skipped[: i + 1]) for i in range(3)]
    assert history.series("train/lr") == pytest.approx([1e-3 * (n + 1) / 4 for n in updates])
    assert history.series("train/lr")[0] == pytest.approx(1e-3 / 4)  # the first update is still to come
    assert module.lr_schedulers().last_epoch == module.trainer.global_step == updates[-1] > 0


@pytest.mark.timeout(300)
def test_nonfinite_steps_in_a_row_stop_the_run_and_leave_the_weights_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(user_losses, "NAN_ON_CALLS", {-1})
    c = validate(
        compose_config(
            *RUN, "max_steps=10", "guards.max_nonfinite_steps=3", "checkpoint.save_interval=1", output_dir=tmp_path
        )
    )
    trainer, module, datamodule = build_run(c)
    before = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    with pytest.raises(NonFiniteTraining, match="3 optimizer steps in a row"):
        try:
            trainer.fit(module, datamodule=datamodule)
        finally:
            datamodule.close()
    assert all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())
    # Steps 1 and 2 were skipped updates (finite weights, checkpointed); step 3 raised before its end.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000001", "step_00000002"]
