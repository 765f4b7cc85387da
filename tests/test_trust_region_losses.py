"""Tests of the newer trust regions (lit_grpo.maths.trust_region_losses, registered as sapo, gmpo
and dppo): values and gradients worked out by hand, an edge case each, autograd against finite
differences, the validation of their own hyper-parameters, and a two-step training run each.

The invariants every registered loss must keep (masking, A = 0, per-token advantages, detached
inputs, on-policy gradient = REINFORCE's, TIS scaling) are tests/test_losses.py's, run over the
whole registry; these three are in it.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_config
from test_losses import leaf, random_inputs, run, t
from torch.testing import assert_close

from lit_grpo.build import build_run
from lit_grpo.config import ConfigError
from lit_grpo.maths.losses import policy_loss, policy_loss_defaults
from lit_grpo.maths.trust_region_losses import DPPO_DEFAULT_THRESHOLDS
from lit_grpo.run.validate import validate

LN3 = math.log(3.0)


def test_defaults():
    assert policy_loss_defaults("sapo") == {
        "kl_beta": 0.0, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
    }  # fmt: skip
    assert policy_loss_defaults("gmpo") == {
        "kl_beta": 0.0, "eps_clip": 0.4, "eps_clip_high": 0.4,
    }  # fmt: skip
    assert policy_loss_defaults("dppo") == {
        "kl_beta": 0.0, "dppo_divergence": "tv",
        "dppo_tv_threshold": None, "dppo_kl_threshold": None, "dppo_ratio_cap": 20.0,
    }  # fmt: skip


# --------------------------------------------------------------------------- sapo


def test_sapo_gate_by_hand():
    # L = -f(r)·A·w, f(r) = σ(τ(r-1))·4/τ; dL/dπ = -4σ(1-σ)·r·A·w. τ_pos = 2, τ_neg = 4, chosen so
    # that σ is 3/4 or 1/4 (τ(r-1) = ±ln3), where 4σ(1-σ) = 3/4.
    # seq 0, A=+1 (τ=2): r = 1 + ln3/2: σ = 3/4, f = 3/4·4/2 = 1.5, L = -1.5, grad -3/4·r
    #                    r = 1:         σ = 1/2, f = 1/2·2 = 1,     L = -1,   grad -1
    # seq 1, A=-2 (τ=4): r = 1 - ln3/4: σ = 1/4, f = 1/4·1 = 0.25; w = 2 (old - inf = ln2):
    #                    L = -0.25·(-2)·2 = 1, grad -3/4·r·(-2)·2 = 3r; its second token is masked out.
    # seq 2, A=0 takes τ_neg = 4 (verl, TRL): r = 1 - ln3/4 gives σ = 1/4, weight 3/4, and L = 0,
    #                    grad 0; r = 1: weight 1.
    # sum = -1.5 - 1 + 1 = -1.5 over 5 tokens; seq_mean = (-2.5/2 + 1/1 + 0)/3 = -0.25/3, its
    # gradient each sequence's divided by its length and by B = 3.
    # gate_weight_mean = (3/4 + 1 + 3/4 + 3/4 + 1)/5 = 0.85 (0.9 had seq 2 taken τ_pos);
    # correction/weight_mean = 6/5.
    r_pos, r_neg = 1 + LN3 / 2, 1 - LN3 / 4
    pi = leaf([[-1.0, -2.0], [-0.5, -1.5], [-3.0, -0.2]])
    old = pi.detach() - torch.log(t([[r_pos, 1.0], [r_neg, 100.0], [r_neg, 1.0]]))
    sampler = old - t([[0.0, 0.0], [math.log(2.0), 0.0], [0.0, 0.0]])
    common = dict(
        pi=pi, old_logprobs=old, sampler_logprobs=sampler, advantages=t([1.0, -2.0, 0.0]),
        mask=t([[1, 1], [1, 0], [1, 1]]), sapo_tau_pos=2.0, sapo_tau_neg=4.0,
    )  # fmt: skip
    loss, grad, metrics = run("sapo", **common)
    assert_close(loss, t(-1.5))
    assert_close(grad, t([[-0.75 * r_pos, -1.0], [3 * r_neg, 0.0], [0.0, 0.0]]))
    assert_close(metrics["sapo/gate_weight_mean"], t(0.85))
    assert_close(metrics["correction/weight_mean"], t(6 / 5))
    assert_close(metrics["clip_frac"], t(0.0))
    loss, grad, _ = run("sapo", normalization="seq_mean", **common)
    assert_close(loss, t(-0.25 / 3))
    assert_close(grad, t([[-0.75 * r_pos / 2, -1.0 / 2], [3 * r_neg, 0.0], [0.0, 0.0]]) / 3)
    loss, _, _ = run("sapo", normalization="token_mean", **common)
    assert_close(loss, t(-1.5 / 5))


def test_sapo_temperature_keeps_the_input_precision():
    # The default τ_neg = 1.05 is not a float32 number; at r = 1 (σ = 1/2) with A = -1 the loss is
    # 2/1.05 to float64 precision, not 2/float32(1.05) (off by 5e-8).
    loss, _, _ = run("sapo", pi=leaf([[-1.0]]), advantages=t([-1.0]))
    assert_close(loss, t(2 / 1.05), rtol=1e-12, atol=0.0)


def test_sapo_rejects_a_non_positive_temperature():
    with pytest.raises(ValueError, match="sapo_tau_pos and sapo_tau_neg must be > 0"):
        run("sapo", pi=leaf([[-1.0]]), advantages=t([1.0]), sapo_tau_neg=0.0)


# --------------------------------------------------------------------------- gmpo


def test_gmpo_geometric_mean_by_hand():
    # ε = 0.4 / 0.4 in log space (the defaults). l = π - old per token, c = its clipped value.
    # seq 0, A=+1, l = [0.6, 0.2, -0.5]: 0.6 > 0.4 -> c = 0.4 (clipped, no gradient); 0.2 kept;
    #   -0.5 kept (A > 0 clips only above). mean c = 0.1/3 -> R0 = e^(1/30).
    #   L = -R0 on each token, grad -A·R0 where unclipped: [0, -R0, -R0].
    # seq 1, A=-2, mask [1, 1, 0], l = [-0.4 (exactly on the edge: kept), 0.8 (A < 0 clips only
    #   below: kept), 7 (masked out)]: mean c = 0.2 -> R1 = e^0.2; L = 2·R1 per token, grad 2·R1.
    # seq 2 has no masked-in token: no loss, no gradient, and 0 in seq_mean's numerator.
    # sum = -3·R0 + 4·R1; clip_frac 1/5; ratio_mean (3·R0 + 2·R1)/5.
    # seq_mean = (-R0 + 2·R1)/3 with gradient [0, -R0/3, -R0/3]/3 and [2·R1/2, 2·R1/2]/3: per
    # sequence, the gradient of the paper's -A·exp(mean c) (∇ of the mean puts 1/|o| on each token).
    pi = leaf([[-1.0, -2.0, -0.5], [-1.0, -0.7, -2.5], [-1.0, -1.0, -1.0]])
    old = t([[-1.6, -2.2, 0.0], [-0.6, -1.5, -9.5], [-3.0, -3.0, -3.0]])
    assert (pi[1, 0] - old[1, 0]).item() == -0.4  # the edge token sits exactly on -ε
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    r0, r1 = math.exp(0.1 / 3), math.exp(0.2)
    common = dict(pi=pi, old_logprobs=old, advantages=t([1.0, -2.0, 1.0]), mask=mask)
    loss, grad, metrics = run("gmpo", **common)
    assert_close(loss, t(-3 * r0 + 4 * r1))
    assert_close(grad, t([[0.0, -r0, -r0], [2 * r1, 2 * r1, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(metrics["clip_frac"], t(1 / 5))
    assert_close(metrics["ratio_mean"], t((3 * r0 + 2 * r1) / 5))
    loss, grad, _ = run("gmpo", normalization="seq_mean", **common)
    assert_close(loss, t((-r0 + 2 * r1) / 3))
    assert_close(grad, t([[0.0, -r0 / 3, -r0 / 3], [r1, r1, 0.0], [0.0, 0.0, 0.0]]) / 3)
    # ε = 0.3 below: now -0.4 < -0.3 clips seq 1's first token to c = -0.3 (a constant):
    # mean c = 0.25, R1 = e^0.25, grad [0, 2·R1].
    _, grad, metrics = run("gmpo", eps_clip=0.3, **common)
    assert_close(grad[1], t([0.0, 2 * math.exp(0.25), 0.0]))
    assert_close(metrics["clip_frac"], t(2 / 5))


def test_gmpo_gradient_is_the_sequence_objectives():
    # With seq_mean, Σ_i mean_t L_it / B must have the gradient of Σ_i -A_i·exp(mean_t c_it) / B,
    # the paper's objective written directly (clip as a where, away from the edges).
    x = random_inputs(11)
    pi = x["pi"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        "gmpo", logprobs=pi, old_logprobs=x["old"], advantages=x["advantages"], mask=x["mask"],
        normalization="seq_mean",
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    log_ratio = pi - x["old"]
    sign = x["advantages"].sign()[:, None]
    clipped = torch.where(sign * log_ratio > 0.4, sign * 0.4, log_ratio)  # ε_low = ε_high: one test per sign
    seq_ratio = torch.exp((clipped * x["mask"]).sum(1) / x["mask"].sum(1).clamp(min=1))
    direct = (-x["advantages"] * seq_ratio * (x["mask"].sum(1) > 0)).sum() / pi.shape[0]
    (expected,) = torch.autograd.grad(direct, pi)
    assert_close(loss, direct.detach())
    assert_close(grad, expected)
    assert grad.abs().sum() > 0


# --------------------------------------------------------------------------- dppo


def dppo_batch():
    # π = log p, old = log p_old, with p and p_old round probabilities; A = [+1, -1].
    p = t([[0.8, 0.5, 0.25], [0.5, 0.6, 0.01]])
    p_old = t([[0.5, 0.25, 0.5], [0.8, 0.2, 1e-10]])
    return dict(pi=torch.log(p).requires_grad_(True), old_logprobs=torch.log(p_old), advantages=t([1.0, -1.0]))


def test_dppo_tv_mask_by_hand():
    # L = -sg(min(r, 20))·π·A on kept tokens, grad -min(r, 20)·A; threshold δ = 0.25.
    # seq 0, A=+1 (drops p - p_old > δ):
    #   0.5 -> 0.8:  D = 0.3 > δ, dropped
    #   0.25 -> 0.5: D = 0.25 exactly on the edge, kept; r = 2: L = -2·ln0.5 = 2ln2, grad -2
    #   0.5 -> 0.25: D = -0.25, kept (A > 0 drops only upward moves); r = 0.5: L = -0.5·ln0.25 = ln2, grad -0.5
    # seq 1, A=-1 (drops p - p_old < -δ):
    #   0.8 -> 0.5:  D = -0.3, dropped
    #   0.2 -> 0.6:  D = 0.4, kept (A < 0 drops only downward moves); r = 3: L = 3·ln0.6, grad 3
    #   1e-10 -> 0.01: D ≈ 0.01, kept; r = 1e8 capped at 20: L = 20·ln0.01, grad 20
    # sum = 3ln2 + 3ln0.6 + 20ln0.01; clip_frac 2/6; ratio_cap_frac 1/6;
    # divergence_mean = (0.3 + 0.25 + 0.25 + 0.3 + 0.4 + 0.01 - 1e-10)/6.
    batch = dppo_batch()
    assert (batch["pi"].exp() - batch["old_logprobs"].exp())[0, 1].item() == 0.25  # the edge is exact
    loss, grad, metrics = run("dppo", dppo_tv_threshold=0.25, **batch)
    assert_close(loss, t(3 * math.log(2) + 3 * math.log(0.6) + 20 * math.log(0.01)))
    assert_close(grad, t([[0.0, -2.0, -0.5], [0.0, 3.0, 20.0]]))
    assert_close(metrics["clip_frac"], t(2 / 6))
    assert_close(metrics["dppo/ratio_cap_frac"], t(1 / 6))
    assert_close(metrics["dppo/divergence_mean"], t((1.5 + 0.01 - 1e-10) / 6))


def test_dppo_kl_mask_by_hand():
    # D = p_old·ln(p_old/p) + (1-p_old)·ln((1-p_old)/(1-p)), dropped when D > δ = 0.2 and p moved
    # the way A pushes it; same batch as the TV test.
    #   seq 0 (A=+1): 0.5 -> 0.8: D = 0.5·ln(0.625) + 0.5·ln(2.5) = ln1.25 = 0.2231 > δ, up: dropped
    #                 0.25 -> 0.5: D = 0.25·ln0.5 + 0.75·ln1.5 = 0.1308: kept
    #                 0.5 -> 0.25: down: kept whatever D
    #   seq 1 (A=-1): 0.8 -> 0.5: D = 0.8·ln1.6 + 0.2·ln0.4 = 0.1927 <= δ: kept (TV dropped it);
    #                 r = 0.625: L = -0.625·ln0.5·(-1) = 0.625·ln0.5, grad 0.625
    #                 the other two moved up: kept
    # sum = the TV sum + 0.625·ln0.5; clip_frac 1/6.
    def bernoulli_kl(q, p):
        return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))

    assert bernoulli_kl(0.5, 0.8) > 0.2 > bernoulli_kl(0.8, 0.5) > bernoulli_kl(0.25, 0.5)
    loss, grad, metrics = run("dppo", dppo_divergence="kl", dppo_kl_threshold=0.2, **dppo_batch())
    assert_close(loss, t(3 * math.log(2) + 3 * math.log(0.6) + 20 * math.log(0.01) + 0.625 * math.log(0.5)))
    assert_close(grad, t([[0.0, -2.0, -0.5], [0.625, 3.0, 20.0]]))
    assert_close(metrics["clip_frac"], t(1 / 6))
    pairs = [(0.5, 0.8), (0.25, 0.5), (0.5, 0.25), (0.8, 0.5), (0.2, 0.6), (1e-10, 0.01)]
    assert_close(metrics["dppo/divergence_mean"], t(sum(bernoulli_kl(q, p) for q, p in pairs) / 6))


def test_dppo_zero_advantage_and_thresholds_are_checked():
    # A = 0 falls on the A <= 0 side of the mask, but its loss and gradient are 0 either way.
    batch = dict(dppo_batch(), advantages=t([0.0, 0.0]))
    loss, grad, metrics = run("dppo", dppo_tv_threshold=0.25, **batch)
    assert_close(loss, t(0.0))
    assert_close(grad, torch.zeros_like(grad))
    assert_close(metrics["clip_frac"], t(1 / 6))  # only 0.8 -> 0.5 dropped (a downward move past δ)
    with pytest.raises(ValueError, match="dppo_divergence must be one of tv, kl"):
        run("dppo", dppo_divergence="js", **dppo_batch())
    with pytest.raises(ValueError, match="must be > 0"):
        run("dppo", dppo_ratio_cap=0.0, **dppo_batch())


def test_dppo_unset_threshold_takes_its_divergences_default():
    # TV 0.2 drops 0.25 -> 0.5 (D = 0.25), which the 0.25 of the TV test keeps: 3 of 6 dropped.
    # KL 0.05 drops seq 0's 0.25 -> 0.5 (D = 0.1308, up) and seq 1's 0.8 -> 0.5 (0.1927, down): 3 of 6.
    assert DPPO_DEFAULT_THRESHOLDS == {"tv": 0.2, "kl": 0.05}
    assert_close(run("dppo", **dppo_batch())[2]["clip_frac"], t(3 / 6))
    assert_close(run("dppo", dppo_tv_threshold=0.2, **dppo_batch())[2]["clip_frac"], t(3 / 6))
    assert_close(run("dppo", dppo_divergence="kl", **dppo_batch())[2]["clip_frac"], t(3 / 6))
    assert_close(run("dppo", dppo_divergence="kl", dppo_kl_threshold=0.2, **dppo_batch())[2]["clip_frac"], t(1 / 6))


@pytest.mark.parametrize(("divergence", "ignored"), [("tv", "dppo_kl_threshold"), ("kl", "dppo_tv_threshold")])
def test_dppo_threshold_of_the_other_divergence_is_refused(divergence, ignored, tmp_path):
    # It would be silently ignored: the loss refuses it, and the config names it before a model loads.
    with pytest.raises(ValueError, match=rf"{ignored} is ignored with dppo_divergence='{divergence}'"):
        run("dppo", dppo_divergence=divergence, **{ignored: 0.1}, **dppo_batch())
    cfg = compose_config(
        "policy_loss=dppo", f"policy_loss.params.dppo_divergence={divergence}", f"policy_loss.params.{ignored}=0.1",
        output_dir=tmp_path,
    )  # fmt: skip
    refused = rf"`policy_loss\.params\.{ignored}`.*is ignored with dppo_divergence={divergence}"
    with pytest.raises(ConfigError, match=refused):
        validate(cfg)


# --------------------------------------------------------------------------- all three


@pytest.mark.parametrize(
    ("name", "hyperparams"),
    [
        ("sapo", {}),
        ("sapo", {"sapo_tau_pos": 3.0, "sapo_tau_neg": 0.5}),
        # A token-level TIS weight w_t multiplies only token t's gradient term of gmpo's shared R (as
        # for gspo): a chosen surrogate, not the derivative of the value. Sequence weights are.
        ("gmpo", {"correction_params": {"level": "sequence"}}),
    ],
)
@pytest.mark.parametrize("normalization", ["token_mean", "seq_mean", "sum"])
def test_autograd_matches_finite_differences(name, hyperparams, normalization):
    # Random inputs sit away from every clip and mask edge, where each loss is smooth in π.
    x = random_inputs(12)

    def loss_of(pi):
        return policy_loss(
            name, logprobs=pi, old_logprobs=x["old"], sampler_logprobs=x["sampler"], advantages=x["advantages"],
            mask=x["mask"], normalization=normalization, **hyperparams,
        )[0]  # fmt: skip

    assert torch.autograd.gradcheck(loss_of, (x["pi"].clone().requires_grad_(True),))


def test_dppo_gradient_on_random_tokens():
    # dppo's ratio is a detached weight (as cispo's), so its gradient is not the value's derivative:
    # check it against the formula instead, -min(r, 20)·A·w on kept tokens, the TV mask written out.
    x = random_inputs(13)
    x["advantages"][0] = 0.0  # A = 0 takes the A <= 0 side of the mask
    pi = x["pi"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        "dppo", logprobs=pi, old_logprobs=x["old"], sampler_logprobs=x["sampler"], advantages=x["advantages"],
        mask=x["mask"], normalization="sum", dppo_tv_threshold=0.1,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    advantages = x["advantages"][:, None].expand_as(pi)
    moved = x["pi"].exp() - x["old"].exp()
    dropped = torch.where(advantages > 0, moved > 0.1, moved < -0.1)
    tis = torch.exp(x["old"] - x["sampler"]).clamp(max=5.0)
    expected = -torch.exp(x["pi"] - x["old"]).clamp(max=20.0) * advantages * tis * ~dropped * x["mask"]
    assert_close(grad, expected)
    assert 0 < metrics["clip_frac"] < 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["sapo", "gmpo", "dppo", "luspo", "vespo"])
def test_two_training_steps(tmp_path, name):
    # The arithmetic demo, two rollout batches of two minibatches each: the second minibatch trains
    # off-policy (r != 1), so the gate, the log-space clip and the mask all see real ratios. The
    # losses stay finite, the loss's own metric is logged, and the weights move.
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=2",
            "batching.ppo_minibatches=2",
            f"policy_loss={name}",
            "~callbacks.reward_filter",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    trainer, module, datamodule = build_run(c)
    before = {key: p.detach().clone() for key, p in module.policy.named_parameters()}
    trainer.fit(module, datamodule=datamodule)
    steps = module.step_sequence.history.steps
    assert len(steps) == 2
    assert all(math.isfinite(step["train/loss"]) for step in steps)
    assert any(abs(step["train/ratio_mean"] - 1.0) > 1e-4 for step in steps)
    own_metric = {
        "sapo": "train/sapo/gate_weight_mean",
        "gmpo": "train/clip_frac",
        "dppo": "train/dppo/divergence_mean",
        "luspo": "train/clip_frac",
        "vespo": "train/vespo/phi_mean",
    }
    assert all(math.isfinite(step[own_metric[name]]) for step in steps)
    moved = [key for key, p in module.policy.named_parameters() if not torch.equal(p.detach(), before[key])]
    assert moved
