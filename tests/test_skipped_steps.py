"""An optimizer step with nothing to learn (no trained token with a non-zero advantage) is skipped:
the weights and the optimizer's state stay bit-identical, `train/skipped_no_signal` counts it, and
the first is said once; a step with a single non-zero advantage still moves. The learning-rate
schedule counts the updates made: a skipped step leaves it where it was. The PPO inner loop
decides per optimizer step; per-token advantages (IGPO's) are read where they are trained. The
2-rank decision (every rank steps or skips together) is in tests/test_ddp.py."""

from __future__ import annotations

import copy
import logging
import warnings

import lightning as L
import pytest
import torch
from test_micro_batches import fit_on, ragged_batch, vocab_size

from lit_grpo.loop.skipped_steps import NO_SIGNAL, NONFINITE, TAKEN, step_verdict
from lit_grpo.maths.health import learning_signal

LENGTHS = [9, 7, 12, 5, 10, 8, 6, 11]


def test_learning_signal_by_hand():
    mask_BT = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 0, 0]], dtype=torch.float32)
    assert not learning_signal(torch.zeros(3), mask_BT)
    assert learning_signal(torch.tensor([0.0, -1e-12, 0.0]), mask_BT)  # any non-zero advantage is signal
    assert not learning_signal(torch.tensor([0.0, 0.0, 2.0]), mask_BT)  # on a row that trains no token
    assert learning_signal(torch.tensor([0.0, float("nan"), 0.0]), mask_BT)  # the non-finite check's to handle
    per_token_BT = torch.zeros(3, 3)
    per_token_BT[0, 0] = per_token_BT[1, 2] = 1.0  # outside the mask: trains nothing
    assert not learning_signal(per_token_BT, mask_BT)
    per_token_BT[1, 1] = 0.5
    assert learning_signal(per_token_BT, mask_BT)


def test_the_verdict_puts_a_nonfinite_step_before_a_step_without_signal():
    finite, nan, yes, no = torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(True), torch.tensor(False)
    assert step_verdict(finite, finite, yes) == TAKEN
    assert step_verdict(finite, finite, no) == NO_SIGNAL
    assert step_verdict(nan, finite, no) == step_verdict(finite, nan, yes) == NONFINITE


class Snapshots(L.Callback):
    """The policy's weights and the optimizer's state before training and after each rollout step,
    and each step's train metrics."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.optimizer: list[dict] = []
        self.metrics: list[dict[str, float]] = []
        self.lr_steps: list[int] = []

    def _take(self, pl_module) -> None:
        self.weights.append({k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()})
        self.optimizer.append(copy.deepcopy(pl_module.optimizers().optimizer.state_dict()))
        self.lr_steps.append(pl_module.lr_schedulers().last_epoch)

    def on_train_start(self, trainer, pl_module) -> None:
        self._take(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._take(pl_module)
        self.metrics.append({k: float(v) for k, v in pl_module.last_step.train_metrics.items()})


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_optimizer_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        state.keys() == b["state"][i].keys() and all(torch.equal(v, b["state"][i][k]) for k, v in state.items())
        for i, state in a["state"].items()
    )


def _with_advantages(lengths: list[int], seed: int, advantages_B: torch.Tensor, **kwargs):
    batch = ragged_batch(lengths, vocab_size(), seed=seed, **kwargs)
    batch.advantages_B = advantages_B
    return batch


@pytest.mark.timeout(300)
def test_a_step_without_signal_leaves_weights_and_optimizer_state_bit_identical(tmp_path, caplog):
    # Steps: no signal (the first: the KL term's gradient is float noise that Adam would scale to a
    # full step), signal, no signal (after Adam has state), a single non-zero advantage.
    zero, one = torch.zeros(len(LENGTHS)), torch.zeros(len(LENGTHS))
    one[3] = 0.5
    batches = [
        _with_advantages(LENGTHS, 0, zero),
        _with_advantages(LENGTHS, 1, torch.randn(len(LENGTHS), generator=torch.Generator().manual_seed(1))),
        _with_advantages(LENGTHS, 2, zero),
        _with_advantages(LENGTHS, 3, one),
    ]
    snapshots = Snapshots()
    with caplog.at_level(logging.WARNING, logger="lit_grpo.loop.skipped_steps"), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")  # skipped on purpose: no torch warning
        fit_on(batches, tmp_path, "policy_loss.kl_beta=0.1", "optim.grad_clip_norm=1.0", callbacks=[snapshots])
    w, opt = snapshots.weights, snapshots.optimizer  # [before, after step 1, ..., after step 4]
    assert _same_weights(w[0], w[1]) and opt[1]["state"] == {}  # nothing moved, Adam untouched
    assert not _same_weights(w[1], w[2])
    assert _same_weights(w[2], w[3]) and _same_optimizer_state(opt[2], opt[3])
    assert not _same_weights(w[3], w[4]) and not _same_optimizer_state(opt[3], opt[4])  # one advantage moves it
    assert [m["train/skipped_no_signal"] for m in snapshots.metrics] == [1.0, 0.0, 1.0, 0.0]
    assert [m["train/skipped_nonfinite"] for m in snapshots.metrics] == [0.0] * 4
    assert snapshots.lr_steps == [0, 0, 1, 1, 2]  # the schedule counts the updates made: a skip leaves it
    said = [r.getMessage() for r in caplog.records if "skipped_no_signal" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 1: no trained token carries a non-zero advantage on any rank")


@pytest.mark.timeout(300)
def test_ppo_minibatches_skip_only_the_optimizer_steps_without_signal(tmp_path):
    # Two minibatches of 4 rows: the first's advantages are all 0, the second's are not.
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.5, -0.5])
    snapshots = Snapshots()
    fit_on([_with_advantages(LENGTHS, 0, advantages)], tmp_path, "batching.ppo_minibatches=2", callbacks=[snapshots])
    (state,) = {int(s["step"]) for s in snapshots.optimizer[1]["state"].values()}
    assert state == 1  # one Adam step: the second minibatch's
    assert snapshots.metrics[0]["train/skipped_no_signal"] == 1.0  # a count over the minibatches
    assert snapshots.lr_steps == [0, 1]  # the skipped minibatch did not advance it


@pytest.mark.timeout(300)
def test_per_token_advantages_are_read_where_they_train(tmp_path):
    # IGPO's advantages are per token: non-zero only on tokens outside the loss mask trains nothing,
    # whatever the per-sequence summary says; one trained token with one does.
    batch = ragged_batch(LENGTHS, vocab_size(), seed=0, per_token=True)
    batch.advantages_B = torch.ones(len(LENGTHS))  # a summary the loss does not read
    outside_BT = torch.zeros_like(batch.loss_mask_BT)
    outside_BT[:, 0] = 3.0  # the prompt: loss mask 0
    batch.advantages_BT = outside_BT
    inside = copy.deepcopy(batch)
    inside.advantages_BT = outside_BT.clone()
    inside.advantages_BT[2, 4] = -0.25  # a trained token (loss mask 1 from position 2)
    snapshots = Snapshots()
    fit_on([batch, inside], tmp_path, callbacks=[snapshots])
    assert _same_weights(snapshots.weights[0], snapshots.weights[1])
    assert not _same_weights(snapshots.weights[1], snapshots.weights[2])
    assert [m["train/skipped_no_signal"] for m in snapshots.metrics] == [1.0, 0.0]
