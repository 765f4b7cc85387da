"""Training-health signals: drift, clipped gradient norm, trained tokens, and the rollout shape,
each against a value worked out by hand, and all of them in the real training loop."""

import csv
import math
from collections import Counter

import lightning as L
import pytest
import torch
from conftest import compose_config

import lit_grpo.rollouts.datamodule
from lit_grpo.build import build_run
from lit_grpo.maths.health import drift_metrics, drift_tis_cap, rollout_health
from lit_grpo.maths.losses import per_token_policy_loss
from lit_grpo.models.load import load_tokenizer
from lit_grpo.rollouts import make_batch, rollout_metrics
from lit_grpo.run.validate import validate
from lit_grpo.train import train
from lit_grpo.types import PromptGroup, RolloutSample

DRIFT_KEYS = ("train/drift/k1", "train/drift/k3", "train/drift/over_tis_cap_frac")
NEW_KEYS = (
    *DRIFT_KEYS,
    "train/grad_norm_clipped",
    "train/tokens",
    "rollout/zero_spread_frac",
    "rollout/truncated_frac",
)


# ------------------------------------------------------------------ pure maths


@pytest.mark.timeout(60)
def test_drift_metrics_by_hand():
    nan, inf = float("nan"), float("inf")
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, nan, -inf]])
    sampler = torch.tensor([[-1.0, -1.0, -1.5], [-0.2, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    m = drift_metrics(trainer, sampler, mask, tis_cap=2.0)
    # Masked-in tokens: r = trainer - sampler = [0, -1, 1, 0.1] (the nan and -inf are padding).
    # k1 = mean(sampler - trainer) = mean(-r) = (0 + 1 - 1 - 0.1) / 4 = -0.025
    # k3 = mean(e^r - 1 - r) = (0 + e^-1 + (e - 2) + (e^0.1 - 1.1)) / 4
    #    = (0 + 0.3678794 + 0.7182818 + 0.0051709) / 4 = 0.2728330
    # weights e^r = [1, 0.368, 2.718, 1.105]: one of 4 above the cap 2 -> 0.25
    assert m["drift/k1"].item() == pytest.approx(-0.025, abs=1e-6)
    assert m["drift/k3"].item() == pytest.approx((math.exp(-1) + math.e - 2 + math.exp(0.1) - 1.1) / 4, abs=1e-6)
    assert m["drift/k3"].item() == pytest.approx(0.2728330, abs=1e-6)
    assert m["drift/over_tis_cap_frac"].item() == 0.25
    # A cap of 3 leaves no token over it; no token masked in gives zeros.
    assert drift_metrics(trainer, sampler, mask, tis_cap=3.0)["drift/over_tis_cap_frac"].item() == 0.0
    empty = drift_metrics(trainer, sampler, torch.zeros_like(mask), tis_cap=2.0)
    assert all(v.item() == 0.0 for v in empty.values())
    # An exact sampler: no drift at all.
    exact = drift_metrics(trainer, torch.where(mask > 0, trainer, 0.0), mask, tis_cap=2.0)
    assert all(v.item() == 0.0 for v in exact.values())
    # Float noise (r of 1e-8 .. 1e-6) never makes k3 negative: k3 is >= 0 on every token.
    tiny = torch.tensor([[1e-8, -1e-8, 3e-7, -1e-6]])
    assert (
        drift_metrics(tiny - 0.5, torch.full_like(tiny, -0.5), torch.ones_like(tiny), tis_cap=2.0)["drift/k3"].item()
        >= 0.0
    )


@pytest.mark.timeout(60)
def test_over_cap_fraction_is_token_level_tis_clip_frac():
    # Reuse, not a second definition: for a token-level TIS loss the two fractions coincide.
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    sampler = old + torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    _, metrics = per_token_policy_loss(
        "grpo",
        logprobs=old.clone(),
        old_logprobs=old,
        sampler_logprobs=sampler,
        advantages=torch.ones(4),
        mask=mask,
        correction_params={"cap": 1.5, "level": "token"},
        kl_beta=0.0,
    )
    drift = drift_metrics(old, sampler, mask, tis_cap=1.5)
    assert drift["drift/over_tis_cap_frac"].item() == pytest.approx(metrics["correction/capped_frac"].item())
    assert 0.0 < drift["drift/over_tis_cap_frac"].item() < 1.0


@pytest.mark.timeout(60)
def test_drift_cap_is_the_corrections_or_the_default():
    assert drift_tis_cap("tis", {"cap": 7.5}) == 7.5
    assert drift_tis_cap("tis", {}) == 5.0
    assert drift_tis_cap("mask", {}) == 3.0  # mask's own default cap
    assert drift_tis_cap("icepop", {"low": 0.2}) == 5.0  # no cap: the default TIS one


@pytest.mark.timeout(60)
def test_rollout_health_by_hand():
    m = rollout_health([True, False, False, True], ["stop", "length", "length", "tool call", "stop"], [3, 8, 8, 2, 5])
    # 2 of 4 groups uniform; 2 of 5 sequences truncated; stop: (3 + 5) / 2, length: 8, "tool call" -> tool_call: 2
    assert m == {
        "rollout/zero_spread_frac": 0.5,
        "rollout/truncated_frac": 0.4,
        "rollout/length_length": 8.0,
        "rollout/length_stop": 4.0,
        "rollout/length_tool_call": 2.0,
    }
    assert rollout_health([], [], []) == {"rollout/zero_spread_frac": 0.0, "rollout/truncated_frac": 0.0}


def _sample(mask, reward, finish_reason="stop"):
    tokens = list(range(1, len(mask) + 1))
    return RolloutSample(
        tokens=tokens, logprobs=[-0.5 * m for m in mask], loss_mask=mask, reward=reward, finish_reason=finish_reason
    )


@pytest.mark.timeout(60)
def test_make_batch_records_and_metrics_pool_two_ranks_by_hand():
    # Rank 0 sampled three groups and trains on the first:
    #   a: rewards [1, 0], trained; sequences: stop with 2 masked tokens, length with 3
    #   b: rewards [1, 1], filtered (uniform)          -> zero spread
    #   c: one run only (dropped_small_group)          -> not counted in zero_spread_frac
    a = PromptGroup(row={}, version=0, samples=[_sample([0, 0, 1, 1], 1.0), _sample([0, 1, 1, 1], 0.0, "length")])
    b = PromptGroup(row={}, version=0, samples=[_sample([0, 1], 1.0), _sample([0, 1], 1.0)])
    c = PromptGroup(row={}, version=0, samples=[_sample([0, 1], 0.0)])
    batch0 = make_batch([a], [a, b, c], version=0, pad_id=0, counts=Counter(), timings={})
    assert batch0.record.zero_spread == [False, True]
    assert batch0.record.finish_reasons == ["stop", "length"]
    assert batch0.record.trained_tokens == [2, 3]
    # Rank 1 trains on one group of two runs with equal rewards (no filter), the first a run of
    # two segments (each trains as a sequence; the group's statistics count runs):
    #   segments: length with 1 token, stop with 2; the second run: stop with 4 tokens.
    d = PromptGroup(
        row={},
        version=0,
        samples=[_sample([0, 1], 0.5, "length"), _sample([0, 1, 1], 0.5), _sample([1, 1, 1, 1], 0.5)],
        run_sizes=[2, 1],
    )
    batch1 = make_batch([d], [d], version=0, pad_id=0, counts=Counter(), timings={})
    assert batch1.record.zero_spread == [True]
    assert batch1.record.trained_tokens == [1, 2, 4]
    m = rollout_metrics([batch0.record, batch1.record])
    # Pooled: groups with >= 2 runs: a (spread), b (none), d (none) -> 2/3.
    # Trained sequences: stop 2, length 3, length 1, stop 2, stop 4 -> truncated 2/5 = 0.4,
    # length_stop = (2 + 2 + 4) / 3 = 8/3, length_length = (3 + 1) / 2 = 2.
    assert m["rollout/zero_spread_frac"] == pytest.approx(2 / 3)
    assert m["rollout/truncated_frac"] == pytest.approx(0.4)
    assert m["rollout/length_stop"] == pytest.approx(8 / 3)
    assert m["rollout/length_length"] == pytest.approx(2.0)


# ------------------------------------------------------------------ the real training loop


def _fit(tmp_path, *overrides, callbacks=()):
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "trainer.fast_dev_run=1",
            "trainer.enable_progress_bar=false",
            *overrides,
            output_dir=tmp_path,
        )
    )
    trainer, module, datamodule = build_run(c, extra_callbacks=list(callbacks))
    trainer.fit(module, datamodule=datamodule)
    return module.step_sequence.history.steps


class PostClipGrads(L.Callback):
    """The gradient norm the optimizer steps with: after clipping, just before the update."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.policy.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


@pytest.mark.timeout(600)
def test_grad_norm_clipped_and_tokens_by_hand(tmp_path):
    # The arithmetic demo: 8 groups of 8 completions of max_completion_tokens=1, no filter, so
    # the step trains 64 sequences of exactly one generated (loss-masked) token: 64 tokens.
    capture = PostClipGrads()
    clip = 1e-3  # far below any gradient norm of a random-init model: the clip always acts
    [step] = _fit(tmp_path / "clip", "~callbacks.reward_filter", f"optim.grad_clip_norm={clip}", callbacks=[capture])
    assert step["train/tokens"] == 64.0
    assert step["train/grad_norm"] > clip
    # ‖g‖·min(1, c / (‖g‖ + 1e-6)) = c·‖g‖ / (‖g‖ + 1e-6) ≈ c; and it is what the optimizer saw.
    assert step["train/grad_norm_clipped"] == pytest.approx(clip, rel=1e-3)
    assert capture.norms == [pytest.approx(step["train/grad_norm_clipped"], rel=1e-4)]
    # grad_clip_norm=0: nothing is clipped, the two norms are the same.
    capture = PostClipGrads()
    [step] = _fit(tmp_path / "noclip", "~callbacks.reward_filter", "optim.grad_clip_norm=0", callbacks=[capture])
    assert step["train/grad_norm_clipped"] == step["train/grad_norm"]
    assert capture.norms == [pytest.approx(step["train/grad_norm"], rel=1e-4)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "loss, overrides, over_cap",
    [
        ("grpo", ("correction.cap=10.0", "batching.ppo_minibatches=2"), 0.0),  # old logprobs from their own forward
        ("reinforce", (), 1.0),  # no TIS weight in the loss: the correction's default cap 5 (below e^2)
    ],
)
def test_drift_by_hand_in_the_training_loop(tmp_path, monkeypatch, loss, overrides, over_cap):
    # Shift every trained token's sampler logprob down by δ = 2: π_s = π_t - 2 (to float noise),
    # so r = π_t - π_s = 2 on every token: k1 = mean(π_s - π_t) = -2, k3 = e^2 - 1 - 2 = 4.389056,
    # and every weight e^2 = 7.389 is above a cap of 2 or 5 (fraction 1) and below 10 (fraction 0).
    real_make_batch = lit_grpo.rollouts.datamodule.make_batch

    def shifted(*args, **kwargs):
        batch = real_make_batch(*args, **kwargs)
        batch.sampler_logprobs_BT = batch.sampler_logprobs_BT - 2.0 * batch.loss_mask_BT
        return batch

    monkeypatch.setattr(lit_grpo.rollouts.datamodule, "make_batch", shifted)
    [step] = _fit(tmp_path, f"policy_loss={loss}", "~callbacks.reward_filter", *overrides)
    assert step["train/drift/k1"] == pytest.approx(-2.0, abs=1e-4)
    assert step["train/drift/k3"] == pytest.approx(math.exp(2) - 3, abs=1e-3)
    assert step["train/drift/over_tis_cap_frac"] == over_cap


@pytest.mark.timeout(900)
def test_health_metrics_in_a_two_step_run(tmp_path):
    # The real loop, uniform-reward filter on: every new key in every step of metrics.csv.
    summary = train(
        compose_config(
            "+experiment=arithmetic", "max_steps=2", "trainer.enable_progress_bar=false", output_dir=tmp_path
        )
    )
    assert summary["steps"] == 2
    with open(tmp_path / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    steps = [row for row in rows if "train/loss" in row]
    assert len(steps) == 2
    for step in steps:
        for key in NEW_KEYS:
            assert key in step, key
        # The HF sampler's logprobs are the trainer's (same weights, same temperature): no drift.
        assert abs(step["train/drift/k1"]) < 1e-4
        assert 0.0 <= step["train/drift/k3"] < 1e-6  # k3 >= 0 on every token
        assert step["train/drift/over_tis_cap_frac"] == 0.0
        assert (
            0.0 < step["train/grad_norm_clipped"] <= min(step["train/grad_norm"], 1.0) + 1e-6
        )  # optim.grad_clip_norm=1
        # One generated token per sequence (max_completion_tokens=1): tokens = accepted groups × G (8).
        assert step["train/tokens"] == step["rollout/groups_accepted"] * 8
        lengths = {k: v for k, v in step.items() if k.startswith("rollout/length_")}
        assert lengths and all(v == 1.0 for v in lengths.values())
        assert 0.0 <= step["rollout/truncated_frac"] <= 1.0
        assert ("rollout/length_length" in step) == (step["rollout/truncated_frac"] > 0)
        # The filter dropped exactly the uniform groups (all have G = 8 runs), so they are the
        # zero-spread ones; the sampled groups are the accepted, the filtered and any surplus
        # kept group of the last refill, so the fraction is at most filtered / (accepted + filtered).
        filtered, accepted = step["rollout/filtered_groups"], step["rollout/groups_accepted"]
        assert (step["rollout/zero_spread_frac"] > 0) == (filtered > 0)
        assert step["rollout/zero_spread_frac"] <= filtered / (accepted + filtered) + 1e-12


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_log_the_metrics_of_one_process_on_the_union(tmp_path):
    # Rank batches of 4 and 6 sequences (ddp_grad_probe's fixed batches, random sampler logprobs,
    # so the drift is far from 0): the metrics merged over 2 DDP ranks must be those of one
    # process on the union: token means weighted by the global token count, norms not doubled.
    import json

    from conftest import run_test_script
    from ddp_grad_probe import fixed_batch, union

    for devices in (1, 2):
        run_test_script("ddp_health_probe.py", str(tmp_path), str(devices), "4,6", cwd=tmp_path)
    [one] = json.loads((tmp_path / "metrics_world1.json").read_text())
    [two] = json.loads((tmp_path / "metrics_world2.json").read_text())
    vocab = len(load_tokenizer(validate(compose_config(output_dir=tmp_path)).model))  # the probe's
    mask = union([fixed_batch(0, 4, vocab), fixed_batch(1, 6, vocab)]).loss_mask_BT[:, 1:]  # aligned to predictions
    assert one["train/tokens"] == two["train/tokens"] == float(mask.sum())
    assert abs(one["train/drift/k1"]) > 0.1 and one["train/drift/k3"] > 0.01
    for key in (*DRIFT_KEYS, "train/grad_norm", "train/grad_norm_clipped", "train/entropy", "train/loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert one["train/grad_norm_clipped"] == pytest.approx(min(one["train/grad_norm"], 0.5), rel=1e-5)
