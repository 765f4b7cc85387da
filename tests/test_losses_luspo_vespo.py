"""Tests of the two sequence-level losses TRL 1.16 added, registered here as luspo
(lit_grpo.maths.ppo_losses: GSPO with each sequence's loss scaled by its length, arXiv 2602.05261)
and vespo (lit_grpo.maths.trust_region_losses: a Gamma-shaped weight of the sequence's whole ratio,
arXiv 2602.10693): values and gradients worked out by hand, each paper's objective written out
independently of the implementation, luspo's length scaling, vespo's asymmetry, gradient signs,
the validation of their hyper-parameters, and a two-step training run each.

The invariants every registered loss keeps (masking, A = 0, per-token advantages, detached
inputs) are tests/test_losses.py's, run over the whole registry; these two are in it.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_config
from test_losses import leaf, random_inputs, run, t
from torch.testing import assert_close

from lit_grpo.config import ConfigError
from lit_grpo.maths.losses import policy_loss, policy_loss_defaults
from lit_grpo.run.validate import validate

E = math.e


def test_defaults():
    # luspo clips as gspo does (the GSPO paper's ε); vespo's k and λ are TRL's (and the VESPO code's).
    assert policy_loss_defaults("luspo") == {"kl_beta": 0.0, "eps_clip": 3e-4, "eps_clip_high": 4e-4}
    assert policy_loss_defaults("vespo") == {
        "kl_beta": 0.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
    }  # fmt: skip
    c = validate(compose_config("policy_loss=luspo"))
    assert c.policy_loss.loss_normalization == "seq_mean"  # what makes it the paper's (1/B)·Σ |o|·ℓ
    assert validate(compose_config("policy_loss=vespo")).policy_loss.loss_normalization == "token_mean"


# --------------------------------------------------------------------------- luspo


def test_luspo_by_hand():
    # ε = 0.2 / 0.3 for round numbers. GSPO's ratio R = exp(masked mean of π - old).
    # seq 0, A=+1, length 3, π - old = [0.1, 0.2, 0.3]: R0 = e^0.2 = 1.2214 inside [0.8, 1.3];
    #   GSPO's per-token term -R0, times |o| = 3: L = -3·R0 per token, grad -3·R0 per token.
    # seq 1, A=-1, length 1 (two padded tokens, π - old = 5 there, ignored): R1 = e^0.2;
    #   A < 0 clips below 0.8 only: L = +R1, grad +R1.
    # sum = 3·(-3R0) + R1 = -8e^0.2.
    # seq_mean = (mean_t of seq 0 + seq 1)/B = (-3e^0.2 + e^0.2)/2 = -e^0.2, which is the paper's
    #   (1/G)·Σ_i |o_i|·min(s_i·A_i, clip(s_i)·A_i) with the sign flipped: (3·(-e^0.2) + e^0.2)/2.
    #   Its gradient: seq 0 each token -3R0/(3·2) = -R0/2, seq 1 R1/2.
    pi = leaf([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.5]])
    old = pi.detach() - t([[0.1, 0.2, 0.3], [0.2, 5.0, 5.0]])
    e = math.exp(0.2)
    common = dict(
        pi=pi, old_logprobs=old, advantages=t([1.0, -1.0]), mask=t([[1, 1, 1], [1, 0, 0]]),
        eps_clip=0.2, eps_clip_high=0.3,
    )  # fmt: skip
    loss, grad, metrics = run("luspo", **common)
    assert_close(loss, t(-8 * e))
    assert_close(grad, t([[-3 * e, -3 * e, -3 * e], [e, 0.0, 0.0]]))
    assert_close(metrics["clip_frac"], t(0.0))
    assert_close(metrics["ratio_mean"], t(e))
    loss, grad, _ = run("luspo", normalization="seq_mean", **common)
    assert_close(loss, t(-e))
    assert_close(grad, t([[-e / 2, -e / 2, -e / 2], [e / 2, 0.0, 0.0]]))
    # ε_high = 0.1 clips seq 0 (R0 > 1.1 with A > 0): its terms become the constant -3·1.1, no gradient.
    loss, grad, metrics = run("luspo", **{**common, "eps_clip_high": 0.1})
    assert_close(loss, t(3 * (-3 * 1.1) + e))
    assert_close(grad, t([[0.0, 0.0, 0.0], [e, 0.0, 0.0]]))
    assert_close(metrics["clip_frac"], t(3 / 4))


def test_luspo_is_gspo_scaled_by_each_sequences_length():
    # The same per-token log-ratio 0.1 and the same A = 1 in a 1-token and a 4-token sequence.
    # gspo under seq_mean gives each sequence the same loss (-R·A) whatever its length, so the
    # long one's tokens share it (gradient -R/4 each, against -R for the short one's token: the
    # length bias LUSPO removes). luspo scales each sequence's loss by its length: the long one
    # weighs 4 times the short one, and every token gets the same gradient, -R/B.
    pi = leaf([[-1.0, 0.0, 0.0, 0.0], [-1.0, -2.0, -0.5, -1.5]])
    old = pi.detach() - 0.1
    mask = t([[1, 0, 0, 0], [1, 1, 1, 1]])
    common = dict(pi=pi, old_logprobs=old, advantages=t([1.0, 1.0]), mask=mask, normalization="seq_mean")
    r = math.exp(0.1)
    loss_g, grad_g, _ = run("gspo", **common, eps_clip=0.2, eps_clip_high=0.2)
    loss_l, grad_l, _ = run("luspo", **common, eps_clip=0.2, eps_clip_high=0.2)
    assert_close(loss_g, t((-r - r) / 2))
    assert_close(loss_l, t((-1 * r - 4 * r) / 2))
    assert_close(grad_g, t([[-r, 0, 0, 0], [-r / 4] * 4]) / 2)
    assert_close(grad_l, t([[-r, 0, 0, 0], [-r] * 4]) / 2)
    lengths = mask.sum(1, keepdim=True)
    assert_close(grad_l, grad_g * lengths)
    # Each sequence's own loss, alone in the batch: luspo's is |o| times gspo's.
    for row in range(2):
        one = {**common, "pi": leaf(pi[row : row + 1].tolist()), "old_logprobs": old[row : row + 1]}
        one.update(advantages=t([1.0]), mask=mask[row : row + 1])
        alone_g = run("gspo", **one, eps_clip=0.2, eps_clip_high=0.2)[0]
        alone_l = run("luspo", **one, eps_clip=0.2, eps_clip_high=0.2)[0]
        assert_close(alone_l, alone_g * lengths[row, 0])


def test_luspo_is_the_papers_objective_under_seq_mean():
    # (1/B)·Σ_i -|o_i|·min(s_i·A_i, clip(s_i, 1-ε, 1+ε_h)·A_i), s_i = exp(mean over o_i of π - old)
    # differentiable through the mean (GSPO's sequence gradient, not the per-token form), written
    # directly: the same value and gradient. Random ratios around 1 with ε = 0.1 clip some sequences.
    x = random_inputs(21, B=6, T=5)
    x["mask"][-1] = 1.0  # every sequence has tokens here
    x["advantages"] = t([1.0, -1.0, 0.5, -2.0, 1.5, -0.5])
    pi = x["pi"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        "luspo", logprobs=pi, old_logprobs=x["old"], advantages=x["advantages"], mask=x["mask"],
        normalization="seq_mean", eps_clip=0.1, eps_clip_high=0.1,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    lengths = x["mask"].sum(1)
    s = torch.exp(((pi - x["old"]) * x["mask"]).sum(1) / lengths)
    a = x["advantages"]
    objective = (lengths * torch.minimum(s * a, s.clamp(0.9, 1.1) * a)).sum() / len(a)
    (expected,) = torch.autograd.grad(-objective, pi)
    assert_close(loss, -objective.detach())
    assert_close(grad, expected)
    assert 0 < metrics["clip_frac"] < 1  # both branches are exercised
    # TRL's luspo reduction of its per-token loss (B, 1) -> (per_token_loss * mask).sum(-1).mean().
    per_seq = -torch.minimum(s * a, s.clamp(0.9, 1.1) * a).detach()[:, None]
    assert_close(loss, (per_seq * x["mask"]).sum(-1).mean())


def test_luspo_on_policy_gradient_is_reinforce_times_the_length():
    x = random_inputs(6)
    x["old"], x["sampler"] = x["pi"].clone(), x["pi"].clone()
    _, grad, _ = _grad("luspo", x, "sum")
    _, grad_reinforce, _ = _grad("reinforce", x, "sum")
    assert grad_reinforce.abs().sum() > 0
    assert_close(grad, grad_reinforce * x["mask"].sum(1, keepdim=True))


# --------------------------------------------------------------------------- vespo


def phi(w, k, lam):
    """The paper's normalized Gamma kernel, W^k·e^(λ(1 - W)), written out."""
    return w**k * math.exp(lam * (1 - w))


def test_vespo_by_hand():
    # W is the product of the token ratios (no length normalization). Defaults: A >= 0 takes
    # k = 2, λ = 3; A < 0 takes k = 3, λ = 2. L_t = -sg(φ(W))·A·π_t, grad -φ(W)·A.
    # seq 0, A=+1, length 2, π - old = [ln 4, -ln 2]: W0 = 4·0.5 = 2 (the geometric mean, GSPO's
    #   ratio, would be √2); φ = 2²·e^(3·(1-2)) = 4e^-3. L = -4e^-3·π = [4e^-3, 8e^-3], grad -4e^-3 each.
    # seq 1, A=-1, length 1 (two padded tokens), π - old = -ln 2: W1 = 0.5; φ = 0.5³·e^(2·0.5) = e/8.
    #   L = -(e/8)·(-1)·(-0.5) = -e/16, grad +e/8.
    # sum = 12e^-3 - e/16. phi_mean over the 3 tokens (8e^-3 + e/8)/3; log_ratio_mean (2·ln2 - ln2)/3.
    pi = leaf([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.0]])
    old = pi.detach() - t([[math.log(4.0), -math.log(2.0), 9.0], [-math.log(2.0), 9.0, -9.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    phi0, phi1 = phi(2.0, 2, 3), phi(0.5, 3, 2)
    assert_close(t([phi0, phi1]), t([4 * E**-3, E / 8]))
    loss, grad, metrics = run("vespo", pi=pi, old_logprobs=old, advantages=t([1.0, -1.0]), mask=mask)
    assert_close(loss, t(12 * E**-3 - E / 16))
    assert_close(grad, t([[-phi0, -phi0, 0.0], [phi1, 0.0, 0.0]]))
    assert_close(metrics["vespo/phi_mean"], t((2 * phi0 + phi1) / 3))
    assert_close(metrics["vespo/log_ratio_mean"], t(math.log(2.0) / 3))
    assert_close(metrics["clip_frac"], t(0.0))
    loss, _, _ = run("vespo", pi=pi, old_logprobs=old, advantages=t([1.0, -1.0]), mask=mask, normalization="token_mean")
    assert_close(loss, t((12 * E**-3 - E / 16) / 3))


def test_vespo_is_asymmetric_in_the_ratio():
    # One token per sequence, π - old = ln W. The weight is 1 on-policy for either sign; for
    # A > 0 it falls fast above 1 (W = 2: 4e^-3 = 0.20) and stays high below (W = 0.5:
    # e^1.5/4 = 1.12); for A < 0 the reverse (W = 2: 8e^-2 = 1.08, W = 0.5: e/8 = 0.34).
    # The gradient is -φ·A: its magnitude is the weight.
    weights = {}
    for sign in (1.0, -1.0):
        for w in (0.5, 1.0, 2.0):
            pi = leaf([[-1.0]])
            _, grad, _ = run("vespo", pi=pi, old_logprobs=pi.detach() - math.log(w), advantages=t([sign]))
            weights[sign, w] = -grad.item() * sign
    assert weights[1.0, 1.0] == pytest.approx(1.0) and weights[-1.0, 1.0] == pytest.approx(1.0)
    assert weights[1.0, 2.0] == pytest.approx(4 * E**-3)
    assert weights[1.0, 0.5] == pytest.approx(E**1.5 / 4)
    assert weights[-1.0, 2.0] == pytest.approx(8 * E**-2)
    assert weights[-1.0, 0.5] == pytest.approx(E / 8)
    assert weights[1.0, 2.0] < weights[-1.0, 2.0] and weights[1.0, 0.5] > weights[-1.0, 0.5]
    # The peak is at W = k/λ: 2/3 for A > 0, 3/2 for A < 0 (each above 1 there).
    for sign, peak, k, lam in ((1.0, 2 / 3, 2, 3), (-1.0, 1.5, 3, 2)):
        pi = leaf([[-1.0]])
        _, grad, _ = run("vespo", pi=pi, old_logprobs=pi.detach() - math.log(peak), advantages=t([sign]))
        assert -grad.item() * sign == pytest.approx(phi(peak, k, lam)) and phi(peak, k, lam) > 1


def test_vespo_folds_the_correction_into_the_ratio():
    # The correction's weight joins W instead of multiplying the loss. One token with
    # old - sampler = ln 2 (tis weight 2, under the cap 5), π - old = -ln 2: W = 0.5·2 = 1, φ = 1,
    # so the gradient is -A = -1 (not 2·φ(0.5) = 2.24, nor φ(0.5)).
    pi = leaf([[-1.0, -2.0]])
    old = pi.detach() - t([[-math.log(2.0), 0.0]])
    sampler = old - t([[math.log(2.0), 0.0]])
    loss, grad, metrics = run("vespo", pi=pi, old_logprobs=old, sampler_logprobs=sampler, advantages=t([1.0]))
    assert_close(grad, t([[-1.0, -1.0]]))
    assert_close(loss, t(3.0))
    assert_close(metrics["correction/weight_mean"], t(1.5))
    # A token the correction drops (mask mode: a weight above its cap is 0) loses its own term and
    # its weight leaves the product; its ratio π/old stays: W = 0.5·1, φ(0.5) = e^1.5/4.
    loss, grad, metrics = run(
        "vespo", pi=pi, old_logprobs=old, sampler_logprobs=sampler, advantages=t([1.0]),
        correction="mask", correction_params={"cap": 1.5, "level": "token"},
    )  # fmt: skip
    assert_close(metrics["correction/masked_frac"], t(0.5))
    assert_close(grad, t([[0.0, -phi(0.5, 2, 3)]]))
    assert_close(loss, t(2.0 * phi(0.5, 2, 3)))


def test_vespo_gradient_is_the_papers_weighted_policy_gradient():
    # ∇J = E[φ(W)·A·∇log π], W = Π_t π_t/old_t over the sequence's tokens, φ detached, k and λ
    # by A's sign, written directly on random inputs (sum normalization, no correction).
    x = random_inputs(22, B=6, T=5)
    x["advantages"] = t([1.0, -1.0, 0.5, -2.0, 0.0, 1.5])
    pi = x["pi"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        "vespo", logprobs=pi, old_logprobs=x["old"], advantages=x["advantages"], mask=x["mask"], normalization="sum"
    )
    (grad,) = torch.autograd.grad(loss, pi)
    w = torch.exp(((x["pi"] - x["old"]) * x["mask"]).sum(1))
    a = x["advantages"]
    k = torch.where(a >= 0, 2.0, 3.0).to(w.dtype)
    lam = torch.where(a >= 0, 3.0, 2.0).to(w.dtype)
    weight = w**k * torch.exp(lam * (1 - w))
    assert_close(grad, -(weight * a)[:, None] * x["mask"])
    assert_close(loss, -(weight[:, None] * a[:, None] * x["pi"] * x["mask"]).sum())


@pytest.mark.parametrize("name", ["luspo", "vespo"])
def test_gradient_signs(name):
    # Descent raises the logprob of a token with A > 0 and lowers it with A < 0, whatever the
    # ratio (luspo: where the clip does not zero it; vespo: φ > 0 always, no clip).
    x = random_inputs(23, B=8, T=6)
    x["mask"][-1] = 1.0
    x["advantages"] = t([1.0, -1.0, 2.0, -0.5, 0.3, -3.0, 1.0, -1.0])
    params = {"eps_clip": 0.2, "eps_clip_high": 0.2} if name == "luspo" else {}
    _, grad, _ = _grad(name, dict(x, sampler=None), "token_mean", **params)
    live = grad[x["mask"] > 0]
    signs = x["advantages"][:, None].expand_as(grad)[x["mask"] > 0]
    assert (live != 0).sum() > len(live) / 2
    assert torch.all((live == 0) | (torch.sign(live) == -torch.sign(signs)))


def _grad(name, x, normalization, **params):
    pi = x["pi"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        name, logprobs=pi, old_logprobs=x["old"], sampler_logprobs=x["sampler"], advantages=x["advantages"],
        mask=x["mask"], normalization=normalization, **params,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    return loss.detach(), grad, metrics


def test_vespo_extreme_ratios_stay_finite():
    # log W beyond ±20 is clamped: φ is 0 for a huge W (e^-λW underflows) and e^(-20k + λ) ~ 1e-16
    # for a tiny one, never inf or nan.
    pi = leaf([[-1.0, -2.0], [-1.0, -2.0]])
    old = pi.detach() - t([[15.0, 15.0], [-15.0, -15.0]])
    loss, grad, _ = run("vespo", pi=pi, old_logprobs=old, advantages=t([-1.0, 1.0]))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_close(grad, torch.zeros_like(grad))


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("vespo_k_pos", -1.0, "must be >= 0"),
        ("vespo_k_neg", -0.5, "must be >= 0"),
        ("vespo_lambda_pos", 0.0, "must be > 0"),
        ("vespo_lambda_neg", -2.0, "must be > 0"),
    ],
)
def test_vespo_hyperparameters_are_checked(key, value, why, tmp_path):
    with pytest.raises(ValueError, match=why):
        run("vespo", pi=leaf([[-1.0]]), advantages=t([1.0]), **{key: value})
    cfg = compose_config("policy_loss=vespo", f"policy_loss.params.{key}={value}", output_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"`policy_loss\.params\.{key}`.*{why}"):
        validate(cfg)


def test_luspo_takes_only_its_clip(tmp_path):
    cfg = compose_config("policy_loss=luspo", "++policy_loss.params.vespo_k_pos=1.0", output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"policy_loss\.params\.vespo_k_pos"):
        validate(cfg)
    cfg = compose_config("policy_loss=luspo", "policy_loss.params.eps_clip=-0.1", output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"policy_loss\.params\.eps_clip"):
        validate(cfg)


@pytest.mark.parametrize("name", ["luspo", "gspo", "grpo", "dapo", "cispo"])
def test_an_eps_clip_whose_lower_clip_never_acts_is_refused(name, tmp_path):
    # 1 - eps_clip <= 0: no ratio exp(.) > 0 is ever below it, so the lower clip would never act.
    cfg = compose_config(f"policy_loss={name}", "policy_loss.params.eps_clip=1.0", output_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"`policy_loss\.params\.eps_clip`.*must be < 1 for '{name}'.*would be 0,"):
        validate(cfg)
    validate(compose_config(f"policy_loss={name}", "policy_loss.params.eps_clip=0.99", output_dir=tmp_path))


def test_gmpo_clips_the_log_ratio_so_an_eps_clip_past_1_acts(tmp_path):
    # gmpo's lower clip is log r < -eps_clip: at eps_clip = 1.5, a ratio below e^-1.5 ≈ 0.22.
    validate(compose_config("policy_loss=gmpo", "policy_loss.params.eps_clip=1.5", output_dir=tmp_path))
    pi = leaf([[-3.0]])
    _, grad, metrics = run("gmpo", pi=pi, old_logprobs=t([[-1.0]]), advantages=t([-1.0]), eps_clip=1.5)
    assert metrics["clip_frac"] == 1.0 and grad.abs().sum() == 0
