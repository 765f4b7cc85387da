"""Tests of lit_grpo.maths.losses: hand-derived values and gradients per variant, invariants over the
whole registry, the aggregation modes, errors, user registration and conf/policy_loss/*.yaml.

Hand cases build `old = π - log(r)` so each token's ratio r is a round number; the expected
loss and gradient (w.r.t. the logprobs) are worked out in the comment above each case.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from lit_grpo.maths.correction import get_correction
from lit_grpo.maths.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    available_policy_losses,
    check_policy_loss_hyperparams,
    per_token_policy_loss,
    policy_loss,
    policy_loss_defaults,
    register_policy_loss,
)

CONF_DIR = Path(__file__).parents[1] / "conf" / "policy_loss"
BUILTIN = (
    "grpo", "dapo", "gspo", "luspo", "cispo", "importance_sampling", "dro", "reinforce",
    "sapo", "gmpo", "dppo", "vespo",
)  # fmt: skip
F64 = torch.float64
LN2 = math.log(2.0)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def leaf(rows) -> torch.Tensor:
    return t(rows).requires_grad_(True)


def old_for(pi: torch.Tensor, ratios) -> torch.Tensor:
    """old logprobs giving the ratio r = exp(π - old) per token."""
    return pi.detach() - torch.log(t(ratios))


def run(name, *, pi, **kwargs):
    """(loss, d loss / d logprobs, metrics); `sum` normalization unless given."""
    kwargs.setdefault("normalization", "sum")
    kwargs.setdefault("old_logprobs", pi.detach())
    kwargs.setdefault("mask", torch.ones_like(pi))
    loss, metrics = policy_loss(name, logprobs=pi, **kwargs)
    (grad,) = torch.autograd.grad(loss, pi, allow_unused=True)
    return loss, (torch.zeros_like(pi) if grad is None else grad), metrics


# --------------------------------------------------------------------------- hand-derived cases


def test_grpo_clips_on_both_sides():
    # ε_low = ε_high = 0.2, band [0.8, 1.2]; dL/dπ of -r·A is -r·A (dr/dπ = r), of -clip(r)·A is 0.
    # seq 0, A=+1, r = 1.5, 1.1, 0.5:
    #   r=1.5: max(-1.5, -1.2) = -1.2  clipped  grad 0
    #   r=1.1: max(-1.1, -1.1) = -1.1           grad -1.1
    #   r=0.5: max(-0.5, -0.8) = -0.5           grad -0.5   (A>0, r<1-ε: no clip)
    # seq 1, A=-1, r = 0.5, 0.9, 1.5:
    #   r=0.5: max(0.5, 0.8)   =  0.8  clipped  grad 0
    #   r=0.9: max(0.9, 0.9)   =  0.9           grad 0.9
    #   r=1.5: max(1.5, 1.2)   =  1.5           grad 1.5    (A<0, r>1+ε: no clip)
    # sum = -1.2 - 1.1 - 0.5 + 0.8 + 0.9 + 1.5 = 0.4; clip_frac = 2/6; ratio_mean = 6.0/6 = 1.
    pi = leaf([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.5]])
    old = old_for(pi, [[1.5, 1.1, 0.5], [0.5, 0.9, 1.5]])
    loss, grad, metrics = run("grpo", pi=pi, old_logprobs=old, advantages=t([1.0, -1.0]), kl_beta=0.0)
    assert_close(loss, t(0.4))
    assert_close(grad, t([[0.0, -1.1, -0.5], [0.0, 0.9, 1.5]]))
    assert_close(metrics["clip_frac"], t(2 / 6))
    assert_close(metrics["ratio_mean"], t(1.0))
    assert "ref_kl" not in metrics


def test_dapo_clip_higher_and_dual_clip():
    # ε_low = 0.2, ε_high = 0.28 (band [0.8, 1.28]), c = 3. Token (0,2) is masked out (r = 100).
    # seq 0, A=+1: r=1.5:  max(-1.5, -1.28) = -1.28 clipped, grad 0
    #              r=1.25: max(-1.25, -1.25) = -1.25 (GRPO's 1.2 would clip it), grad -1.25
    # seq 1, A=-1: r=5:    max(5, 1.28) = 5 -> dual clip min(3·1, 5) = 3 (constant), grad 0
    #              r=2:    max(2, 1.28) = 2 -> min(3, 2) = 2, grad -r·A = 2
    #              r=0.5:  max(0.5, 0.8) = 0.8 clipped -> min(3, 0.8) = 0.8, grad 0
    # sum = -1.28 - 1.25 + 3 + 2 + 0.8 = 3.27 over 5 tokens; clip_frac 2/5, dual_clip_frac 1/5.
    # Without c, r=5 keeps 5 with grad 5: sum 5.27.
    pi = leaf([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.5]])
    old = old_for(pi, [[1.5, 1.25, 100.0], [5.0, 2.0, 0.5]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    common = dict(pi=pi, old_logprobs=old, advantages=t([1.0, -1.0]), mask=mask)
    loss, grad, metrics = run("dapo", eps_clip_c=3.0, **common)
    assert_close(loss, t(3.27))
    assert_close(grad, t([[0.0, -1.25, 0.0], [0.0, 2.0, 0.0]]))
    assert_close(metrics["clip_frac"], t(2 / 5))
    assert_close(metrics["dual_clip_frac"], t(1 / 5))
    loss, grad, metrics = run("dapo", **common)
    assert_close(loss, t(5.27))
    assert_close(grad, t([[0.0, -1.25, 0.0], [5.0, 2.0, 0.0]]))
    assert_close(metrics["dual_clip_frac"], t(0.0))
    loss, _, _ = run("dapo", normalization="token_mean", **common)
    assert_close(loss, t(5.27 / 5))


def test_gspo_sequence_ratio_with_partial_mask():
    # ε_low = 0.2, ε_high = 0.3 for round numbers. seq 0: mask [1, 1, 0], π-old = [0.1, 0.3, 5.0]
    # -> s = (0.1 + 0.3)/2 = 0.2 (the masked 5.0 is ignored), R = e^0.2 = 1.221403 in [0.8, 1.3];
    # A=+1: L = -R on each token, grad = -A·R = -e^0.2 (dR/dπ_t = R via π - sg(π)).
    # seq 1: π-old = [-1.0, -0.6, -0.8] -> s = -0.8, R = e^-0.8 = 0.449329 < 0.8; A=-1:
    # max(R, 0.8) = 0.8 clipped, grad 0.
    # sum = -2e^0.2 + 3·0.8 = -0.042806; clip_frac 3/5; ratio_mean (2e^0.2 + 3e^-0.8)/5.
    pi = leaf([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.5]])
    old = pi.detach() - t([[0.1, 0.3, 5.0], [-1.0, -0.6, -0.8]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    loss, grad, metrics = run(
        "gspo", pi=pi, old_logprobs=old, advantages=t([1.0, -1.0]), mask=mask, eps_clip=0.2, eps_clip_high=0.3
    )
    e = math.exp(0.2)
    assert_close(loss, t(-2 * e + 2.4))
    assert_close(grad, t([[-e, -e, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(metrics["clip_frac"], t(3 / 5))
    assert_close(metrics["ratio_mean"], t((2 * e + 3 * math.exp(-0.8)) / 5))


def test_gspo_exponent_capped_at_10():
    # π-old = 12 on both tokens -> s = 12, R = exp(min(12, 10)) = e^10; A=-1: max(e^10, 1.0004)
    # = e^10 per token, and the cap (a constant past 10) leaves no gradient.
    pi = leaf([[-1.0, -2.0]])
    loss, grad, _ = run("gspo", pi=pi, old_logprobs=pi.detach() - 12.0, advantages=t([-1.0]))
    assert_close(loss, t(2 * math.exp(10.0)))
    assert_close(grad, torch.zeros_like(pi))


def test_cispo_gradient_is_detached_clipped_ratio():
    # band [0.8, 1.28]; L = -sg(clip(r))·π·A·w, so dL/dπ = -clip(r)·A·w whatever r's slope.
    # w: old - inf = ln 1.5 on token (0,0) (under the cap 5 -> w = 1.5), 1 elsewhere.
    #   (0,0) π=-1,   r=1.5 -> 1.28, A=+1, w=1.5: L = -1.28·(-1)·1.5 = 1.92,  grad -1.92
    #   (0,1) π=-2,   r=1.1 -> 1.1,  A=+1:        L = -1.1·(-2)     = 2.2,   grad -1.1
    #   (1,0) π=-0.5, r=0.5 -> 0.8,  A=-1:        L = 0.8·(-0.5)    = -0.4,  grad 0.8
    #   (1,1) π=-1.5, r=2   -> 1.28, A=-1:        L = 1.28·(-1.5)   = -1.92, grad 1.28
    # sum = 1.92 + 2.2 - 0.4 - 1.92 = 1.8; clip_frac 3/4 (r outside the band).
    pi = leaf([[-1.0, -2.0], [-0.5, -1.5]])
    old = old_for(pi, [[1.5, 1.1], [0.5, 2.0]])
    sampler = old - t([[math.log(1.5), 0.0], [0.0, 0.0]])
    loss, grad, metrics = run("cispo", pi=pi, old_logprobs=old, sampler_logprobs=sampler, advantages=t([1.0, -1.0]))
    assert_close(loss, t(1.8))
    assert_close(grad, t([[-1.92, -1.1], [0.8, 1.28]]))
    assert_close(metrics["clip_frac"], t(3 / 4))


def test_importance_sampling_with_per_token_advantages():
    # A is [B, T] = [[1, -1]]; r = [2, 0.5]: L = -r·A = [-2, 0.5], grad -r·A = [-2, 0.5]; sum -1.5.
    pi = leaf([[-1.0, -2.0]])
    old = old_for(pi, [[2.0, 0.5]])
    loss, grad, metrics = run("importance_sampling", pi=pi, old_logprobs=old, advantages=t([[1.0, -1.0]]))
    assert_close(loss, t(-1.5))
    assert_close(grad, t([[-2.0, 0.5]]))
    assert_close(metrics["ratio_mean"], t(1.25))
    assert_close(metrics["clip_frac"], t(0.0))


def test_dro_quadratic_term():
    # β = 0.5, A = +1. Token 0: π=-1, old=-1.5 (π-old = 0.5), w = 2 (old - inf = ln 2, cap 5):
    #   L = -(π·A·w - ½β(π-old)²) = -(-2 - 0.25·0.25) = 2.0625
    #   grad = -(A·w - β(π-old)) = -(2 - 0.5·0.5) = -1.75
    # Token 1: π=-2 = old, w = 1: L = -(-2) = 2, grad = -1. sum = 4.0625.
    pi = leaf([[-1.0, -2.0]])
    old = t([[-1.5, -2.0]])
    loss, grad, _ = run(
        "dro", pi=pi, old_logprobs=old, sampler_logprobs=old - t([[LN2, 0.0]]), advantages=t([1.0]), dro_beta=0.5
    )
    assert_close(loss, t(4.0625))
    assert_close(grad, t([[-1.75, -1.0]]))


def test_reinforce_off_policy_ratio_to_the_sampler():
    # L = -exp(π - inf)·A per token (d/dπ: the same, -exp(π - inf)·A); old plays no part, no TIS.
    # π = [ln 0.5, ln 0.25, (ln 0.1, masked)], inf = [ln 0.4, ln 0.5, (nan)], A = 1.5:
    #   ratios 0.5/0.4 = 1.25 and 0.25/0.5 = 0.5: L = [-1.875, -0.75, 0], grad the same.
    # sum -2.625; ratio_mean (1.25 + 0.5)/2 = 0.875.
    pi = leaf([[math.log(0.5), math.log(0.25), math.log(0.1)]])
    sampler = t([[math.log(0.4), math.log(0.5), math.nan]])
    common = dict(pi=pi, sampler_logprobs=sampler, advantages=t([1.5]), mask=t([[1, 1, 0]]))
    loss, grad, metrics = run("reinforce", old_logprobs=pi.detach() - 3.0, **common)
    assert_close(loss, t(-2.625))
    assert_close(grad, t([[-1.875, -0.75, 0.0]]))
    assert_close(metrics["ratio_mean"], t(0.875))
    assert "correction/weight_mean" not in metrics
    loss_old, grad_old, _ = run("reinforce", old_logprobs=pi.detach() + 1.0, **common)
    assert_close(loss_old, loss)
    assert_close(grad_old, grad)


def test_reinforce_log_ratio_clamped_at_20():
    # π - inf = [25, -25] -> clamped to [20, -20]: L = -e^20·A and -e^-20·A, A = -1; past the
    # clamp the ratio is a constant, so no gradient.
    pi = leaf([[-1.0, -2.0]])
    loss, grad, _ = run("reinforce", pi=pi, sampler_logprobs=pi.detach() - t([[25.0, -25.0]]), advantages=t([-1.0]))
    assert_close(loss, t(math.exp(20.0) + math.exp(-20.0)))
    assert_close(grad, torch.zeros_like(pi))


def test_reinforce_on_policy_is_plain_reinforce():
    # With no sampler logprobs (inf = sg(π)) or with inf = π: ratio 1 in value, so L = -A per
    # token, and its gradient is -A·∇π, that of -π·A. π = [[-1, -2, (-3)], [-0.5, (-4), (-6)]],
    # A = [2, -1]: L = [[-2, -2], [1]], sum -3; grad [[-2, -2, 0], [1, 0, 0]].
    pi = leaf([[-1.0, -2.0, -3.0], [-0.5, -4.0, -6.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    advantages = t([2.0, -1.0])
    (expected,) = torch.autograd.grad((-pi * advantages[:, None] * mask).sum(), pi)
    assert_close(expected, t([[-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]]))
    for sampler in (None, pi.detach().clone()):
        loss, grad, metrics = run("reinforce", pi=pi, sampler_logprobs=sampler, advantages=advantages, mask=mask)
        assert_close(loss, t(-3.0))
        assert_close(grad, expected)
        assert_close(metrics["ratio_mean"], t(1.0))


def test_tis_token_and_sequence_level():
    # importance_sampling on-policy (π = old, r = 1), so L = -A·w and grad = -A·w; cap 5.
    # old - inf = [[ln2, ln8, ln100 (masked)], [ln4, ln16, ln64]], A = [1, -2].
    # token:    w = [[2, 5 (8 capped), 1 (masked)], [4, 5 (16), 5 (64)]]
    #           sum = -(2+5) + 2·(4+5+5) = 21; weight_mean 21/5; capped 3/5.
    # sequence: seq 0 masked mean (ln2+ln8)/2 = ln4 -> w = 4; seq 1 mean ln16 -> 16 capped to 5.
    #           w = [[4, 4, 1 (masked)], [5, 5, 5]]; sum = -8 + 30 = 22; weight_mean 23/5;
    #           capped: the 3 tokens of seq 1 -> 3/5.
    pi = leaf([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.5]])
    sampler = pi.detach() - torch.log(t([[2.0, 8.0, 100.0], [4.0, 16.0, 64.0]]))
    mask = t([[1, 1, 0], [1, 1, 1]])
    common = dict(pi=pi, sampler_logprobs=sampler, advantages=t([1.0, -2.0]), mask=mask, correction_params={"cap": 5.0})
    loss, grad, metrics = run("importance_sampling", **common)
    assert_close(loss, t(21.0))
    assert_close(grad, t([[-2.0, -5.0, 0.0], [8.0, 10.0, 10.0]]))
    assert_close(metrics["correction/weight_mean"], t(21 / 5))
    assert_close(metrics["correction/capped_frac"], t(3 / 5))
    loss, grad, metrics = run(
        "importance_sampling", **{**common, "correction_params": {"cap": 5.0, "level": "sequence"}}
    )
    assert_close(loss, t(22.0))
    assert_close(grad, t([[-4.0, -4.0, 0.0], [10.0, 10.0, 10.0]]))
    assert_close(metrics["correction/weight_mean"], t(23 / 5))
    assert_close(metrics["correction/capped_frac"], t(3 / 5))


def test_tis_cap_defaults_to_5():
    # The cookbook's TISConfig.cap. importance_sampling on-policy (r = 1), A = 1, no cap given:
    # old - inf = [ln 4, ln 8, ln 100] -> w = [4, 5, 5]; L = -w, sum -14, grad -w; capped 2/3.
    assert get_correction("tis").defaults == {"level": "token", "cap": 5.0}
    pi = leaf([[-1.0, -2.0, -0.5]])
    sampler = pi.detach() - torch.log(t([[4.0, 8.0, 100.0]]))
    loss, grad, metrics = run("importance_sampling", pi=pi, sampler_logprobs=sampler, advantages=t([1.0]))
    assert_close(loss, t(-14.0))
    assert_close(grad, t([[-4.0, -5.0, -5.0]]))
    assert_close(metrics["correction/capped_frac"], t(2 / 3))


def test_tis_without_sampler_logprobs_is_one():
    pi = leaf([[-1.0, -2.0]])
    loss, grad, metrics = run("importance_sampling", pi=pi, advantages=t([1.0]), correction_params={"cap": 0.5})
    assert_close(grad, t([[-1.0, -1.0]]))
    assert_close(metrics["correction/weight_mean"], t(1.0))
    assert_close(metrics["correction/capped_frac"], t(0.0))


def test_k3_kl_term_value_and_gradient():
    # A = 0 isolates the KL term β·k3(ref, π), k3 = e^x - x - 1 with x = ref - π, dk3/dπ = 1 - e^x.
    #   x = ln2:   k3 = 2 - ln2 - 1 = 1 - ln2,  dk3/dπ = 1 - 2 = -1
    #   x = -ln2:  k3 = 0.5 + ln2 - 1 = ln2 - 0.5, dk3/dπ = 1 - 0.5 = 0.5
    # β = 0.1: sum = 0.1·(1 - ln2 + ln2 - 0.5) = 0.05; grad = [-0.1, 0.05]; ref_kl = 0.5/2 = 0.25.
    # ppo_kl = k3(old, π) with old - π = -ln2 on token 0 (r = 2): (ln2 - 0.5)/2.
    pi = leaf([[-1.0, -2.0]])
    ref = pi.detach() + t([[LN2, -LN2]])
    old = old_for(pi, [[2.0, 1.0]])
    loss, grad, metrics = run("grpo", pi=pi, old_logprobs=old, ref_logprobs=ref, advantages=t([0.0]), kl_beta=0.1)
    assert_close(loss, t(0.05))
    assert_close(grad, t([[-0.1, 0.05]]))
    assert_close(metrics["ref_kl"], t(0.25))
    assert_close(metrics["ppo_kl"], t((LN2 - 0.5) / 2))
    # With A = 1 on-policy the surrogate adds -1 per token and grad -1: the terms just add.
    loss, grad, _ = run("grpo", pi=pi, ref_logprobs=ref, advantages=t([1.0]), kl_beta=0.1)
    assert_close(loss, t(0.05 - 2.0))
    assert_close(grad, t([[-1.1, -0.95]]))


def test_aggregate_loss_modes():
    # masked L: seq 0 [1, 2], seq 1 [4]. token_mean (1+2+4)/3; with num_tokens=7 -> 7/7.
    # seq_mean ((1+2)/2 + 4)/2 = 2.75; with num_sequences=4 -> 5.5/4; sum 7.
    # An empty sequence contributes 0: ((1+2)/2 + 0)/2 = 0.75.
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(aggregate_loss(loss, mask, "token_mean"), t(7 / 3))
    assert_close(aggregate_loss(loss, mask, "token_mean", num_tokens=7), t(1.0))
    assert_close(aggregate_loss(loss, mask, "seq_mean"), t(2.75))
    assert_close(aggregate_loss(loss, mask, "seq_mean", num_sequences=4), t(1.375))
    assert_close(aggregate_loss(loss, mask, "sum"), t(7.0))
    assert_close(aggregate_loss(loss, mask.bool() & t([[1, 1, 1], [0, 0, 0]]).bool(), "seq_mean"), t(0.75))
    with pytest.raises(ValueError, match="token_mean, seq_mean, sum"):
        aggregate_loss(loss, mask, "mean")


def test_policy_loss_normalizations_and_num_tokens():
    # cispo on-policy (r = 1 inside the band, w = 1) is -π·A; with A = 1: L = -π =
    # [[1, 2, (3 masked)], [4, (5), (6)]], grad -1 on masked-in tokens.
    # token_mean: 7/3, grad -1/3; num_tokens=14: 7/14 = 0.5, grad -1/14;
    # seq_mean: (1.5 + 4)/2 = 2.75, grad [[-1/4, -1/4, 0], [-1/2, 0, 0]].
    pi = leaf([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    common = dict(pi=pi, advantages=t([1.0, 1.0]), mask=torch.tensor([[True, True, False], [True, False, False]]))
    loss, grad, _ = run("cispo", normalization="token_mean", **common)
    assert_close(loss, t(7 / 3))
    assert_close(grad, t([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]]) / 3)
    loss, grad, _ = run("cispo", normalization="token_mean", num_tokens=14, **common)
    assert_close(loss, t(0.5))
    assert_close(grad, t([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]]) / 14)
    loss, grad, _ = run("cispo", normalization="seq_mean", **common)
    assert_close(loss, t(2.75))
    assert_close(grad, t([[-0.25, -0.25, 0.0], [-0.5, 0.0, 0.0]]))
    loss, _, _ = run("cispo", normalization="seq_mean", num_sequences=5, **common)
    assert_close(loss, t(5.5 / 5))


# --------------------------------------------------------------------------- registry invariants


def random_inputs(seed: int = 0, B: int = 3, T: int = 5):
    gen = torch.Generator().manual_seed(seed)
    pi = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    old = pi - 0.4 * torch.randn(B, T, generator=gen, dtype=F64)
    sampler = old - 0.4 * torch.randn(B, T, generator=gen, dtype=F64)
    ref = pi - 0.4 * torch.randn(B, T, generator=gen, dtype=F64)
    mask = (torch.rand(B, T, generator=gen) > 0.3).to(F64)
    mask[0, 0], mask[-1] = 1.0, 0.0  # one masked-in token at least; one fully masked sequence
    advantages = torch.randn(B, generator=gen, dtype=F64)
    return dict(pi=pi, old=old, sampler=sampler, ref=ref, mask=mask, advantages=advantages)


def grad_of(name, x, normalization="token_mean", **hyperparams):
    pi = x["pi"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        name, logprobs=pi, old_logprobs=x["old"], sampler_logprobs=x["sampler"], ref_logprobs=x["ref"],
        advantages=x["advantages"], mask=x["mask"], normalization=normalization, **hyperparams,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi, allow_unused=True)
    return loss.detach(), (torch.zeros_like(pi) if grad is None else grad), metrics


def tis_levels(name):
    return ["token", "sequence"] if POLICY_LOSSES[name].uses_tis else [None]


def level_kwargs(level):
    return {} if level is None else {"correction_params": {"level": level}}


@pytest.fixture(params=available_policy_losses())
def name(request):
    return request.param


def test_builtin_variants_registered():
    assert set(BUILTIN) <= set(available_policy_losses())
    assert not POLICY_LOSSES["reinforce"].uses_tis  # its ratio is to the sampler already
    assert policy_loss_defaults("grpo")["kl_beta"] == 0.001
    assert all(policy_loss_defaults(n)["kl_beta"] == 0.0 for n in BUILTIN if n != "grpo")


def test_zero_advantages_give_zero_gradient(name):
    # On-policy values (π = old) so dro's proximal term ½β(π-old)², which pulls π back to old even
    # when A = 0 (by design), is flat; the sampler still differs, so TIS weights are not 1.
    for level in tis_levels(name):
        x = random_inputs(1)
        x["old"] = x["pi"].clone()
        x["advantages"] = torch.zeros_like(x["advantages"])
        loss, grad, _ = grad_of(name, x, kl_beta=0.0, **level_kwargs(level))
        assert_close(grad, torch.zeros_like(grad))
        assert_close(loss, t(0.0))


@pytest.mark.parametrize("normalization", ["token_mean", "seq_mean", "sum"])
@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_masked_tokens_change_nothing(name, normalization, per_token_advantages):
    # Padding values, even inf and nan, must reach neither the loss, the gradient nor the metrics.
    for level in tis_levels(name):
        x = random_inputs(2)
        if per_token_advantages:
            x["advantages"] = x["advantages"][:, None] * torch.linspace(0.5, 1.5, x["pi"].shape[1], dtype=F64)
        y = {key: value.clone() for key, value in x.items()}
        off = x["mask"] == 0
        gen = torch.Generator().manual_seed(3)
        first_off = tuple(off.nonzero()[0].tolist())
        for key, extreme in (("pi", -math.inf), ("old", math.inf), ("sampler", math.nan), ("ref", math.inf)):
            y[key][off] = -1e4 * torch.rand(int(off.sum()), generator=gen, dtype=F64)
            y[key][first_off] = extreme
        if per_token_advantages:
            y["advantages"][off] = math.nan
        kwargs = dict(normalization=normalization, kl_beta=0.05, **level_kwargs(level))
        loss_x, grad_x, metrics_x = grad_of(name, x, **kwargs)
        loss_y, grad_y, metrics_y = grad_of(name, y, **kwargs)
        assert grad_x.abs().sum() > 0
        assert_close(loss_y, loss_x)
        assert_close(grad_y, grad_x)
        assert_close(grad_x[off], torch.zeros_like(grad_x[off]))
        assert metrics_x.keys() == metrics_y.keys()
        for key in metrics_x:
            assert_close(metrics_y[key], metrics_x[key], msg=key)


def test_per_sequence_advantages_equal_broadcast(name):
    x = random_inputs(4)
    y = dict(x, advantages=x["advantages"][:, None].expand_as(x["pi"]).clone())
    loss_x, grad_x, _ = grad_of(name, x, kl_beta=0.0)
    loss_y, grad_y, _ = grad_of(name, y, kl_beta=0.0)
    assert_close(loss_y, loss_x)
    assert_close(grad_y, grad_x)


def test_metrics_are_detached_scalars(name):
    x = random_inputs(5)
    _, _, metrics = grad_of(name, x, kl_beta=0.01)
    expected = {"clip_frac", "ratio_mean", "ppo_kl", "ref_kl"}
    if POLICY_LOSSES[name].uses_tis:
        expected |= {"correction/weight_mean", "correction/capped_frac"}
    assert expected <= metrics.keys()
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.ndim == 0 and not value.requires_grad, key
    _, _, metrics = grad_of(name, x, kl_beta=0.0)
    assert "ref_kl" not in metrics


@pytest.mark.parametrize(
    "variant", ["grpo", "dapo", "gspo", "cispo", "importance_sampling", "dro", "sapo", "gmpo", "dppo", "vespo"]
)
def test_on_policy_gradient_equals_reinforce(variant):
    # π = old = sampler in value (old/sampler detached): r = R = w = 1, no clip, no proximal pull,
    # sapo's gate weight 4σ(0)(1 - σ(0)) = 1, no dppo mask, vespo's φ(1) = 1, and reinforce's ratio
    # to the sampler is 1, so every gradient is -A per token, REINFORCE's. (luspo's is that times
    # the sequence's length: tests/test_losses_luspo_vespo.py.)
    # ref = π too, so grpo's k3 has zero gradient.
    x = random_inputs(6)
    x["old"], x["sampler"], x["ref"] = x["pi"].clone(), x["pi"].clone(), x["pi"].clone()
    _, grad, _ = grad_of(variant, x)
    _, grad_reinforce, _ = grad_of("reinforce", x)
    assert grad_reinforce.abs().sum() > 0
    assert_close(grad, grad_reinforce)


@pytest.mark.parametrize(
    "variant", ["grpo", "dapo", "gspo", "luspo", "cispo", "importance_sampling", "sapo", "gmpo", "dppo"]
)
def test_uniform_tis_weight_scales_loss(variant):
    # These losses are (surrogate)·w, so old - inf = ln 1.5 everywhere (under the cap 5) multiplies
    # loss and gradient by 1.5 compared with no sampler logprobs (w = 1). (vespo puts w in its
    # sequence ratio instead: tests/test_losses_luspo_vespo.py.)
    x = random_inputs(8)
    x["sampler"] = x["old"] - math.log(1.5)
    loss_w, grad_w, metrics = grad_of(variant, x, kl_beta=0.0)
    loss_1, grad_1, _ = grad_of(variant, dict(x, sampler=None), kl_beta=0.0)
    assert_close(metrics["correction/weight_mean"], t(1.5))
    assert_close(loss_w, 1.5 * loss_1)
    assert_close(grad_w, 1.5 * grad_1)


def test_only_logprobs_carry_gradient(name):
    # old, sampler, ref and advantages built from π with a live graph must still act as constants.
    x = random_inputs(9)
    pi = x["pi"].clone().requires_grad_(True)
    live = dict(
        old_logprobs=pi + (x["old"] - x["pi"]),
        sampler_logprobs=pi + (x["sampler"] - x["pi"]),
        ref_logprobs=pi + (x["ref"] - x["pi"]),
        advantages=x["advantages"] + 0 * pi[:, 0],
    )
    loss, _ = policy_loss(name, logprobs=pi, mask=x["mask"], kl_beta=0.05, **live)
    (grad,) = torch.autograd.grad(loss, pi)
    _, grad_detached, _ = grad_of(name, x, kl_beta=0.05)
    assert_close(grad, grad_detached)


# --------------------------------------------------------------------------- errors


def simple_call(name="grpo", **kwargs):
    pi = t([[-1.0, -2.0]])
    base = dict(logprobs=pi, old_logprobs=pi, ref_logprobs=pi, advantages=t([1.0]), mask=torch.ones_like(pi))
    return policy_loss(name, **{**base, **kwargs})


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'") as err:
        simple_call("ppo")
    assert all(n in str(err.value) for n in BUILTIN)
    with pytest.raises(ValueError, match="grpo"):
        check_policy_loss_hyperparams("nope", {})


@pytest.mark.parametrize(("variant", "key"), [("grpo", "dro_beta"), ("reinforce", "tis_cap"), ("dapo", "eps_clipp")])
def test_unsupported_hyperparameter_named(variant, key):
    with pytest.raises(ValueError, match=f"does not take {key}.*valid hyper-parameters: .*kl_beta"):
        simple_call(variant, **{key: 0.1})
    with pytest.raises(ValueError, match=key):
        check_policy_loss_hyperparams(variant, {key: 0.1})


def test_invalid_shared_hyperparameter_values():
    with pytest.raises(ValueError, match="kl_beta"):
        check_policy_loss_hyperparams("grpo", {"kl_beta": -1.0})
    with pytest.raises(ValueError, match="its own group: correction=tis"):  # the former loss knob says where it went
        check_policy_loss_hyperparams("grpo", {"tis_cap": 2.0})


def test_kl_without_reference_raises():
    with pytest.raises(ValueError, match="ref_logprobs"):
        simple_call("grpo", ref_logprobs=None)  # grpo's default kl_beta is 0.001
    with pytest.raises(ValueError, match="ref_logprobs"):
        simple_call("dapo", ref_logprobs=None, kl_beta=0.1)
    simple_call("dapo", ref_logprobs=None)  # kl_beta = 0: the reference is never read


def test_unknown_normalization_raises():
    with pytest.raises(ValueError, match="token_mean, seq_mean, sum"):
        simple_call(normalization="mean")


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="advantages"):
        simple_call(advantages=t([1.0, 2.0]))
    with pytest.raises(ValueError, match="old_logprobs"):
        simple_call(old_logprobs=t([[-1.0]]))


# --------------------------------------------------------------------------- user registration


@pytest.fixture
def scaled_pg():
    @register_policy_loss("test_scaled_pg", scale=2.0)
    def scaled_pg_loss(*, logprobs, old_logprobs, advantages, mask, tis_weight, scale):
        return -scale * logprobs * advantages * tis_weight, {"scale": torch.tensor(scale)}

    yield "test_scaled_pg"
    POLICY_LOSSES.pop("test_scaled_pg")


def test_user_registered_variant(scaled_pg):
    # L = -scale·π·A·w: scale 3, A = 1, w = [2 (old - inf = ln2, under the cap 5), 1]; π = [-1, -2]
    # sum = 3·(1·2 + 2·1) = 12, grad = -3·w = [-6, -3].
    assert scaled_pg in available_policy_losses()
    assert policy_loss_defaults(scaled_pg) == {"kl_beta": 0.0, "scale": 2.0}
    pi = leaf([[-1.0, -2.0]])
    sampler = pi.detach() - t([[LN2, 0.0]])
    loss, grad, metrics = run(scaled_pg, pi=pi, sampler_logprobs=sampler, advantages=t([1.0]), scale=3.0)
    assert_close(loss, t(12.0))
    assert_close(grad, t([[-6.0, -3.0]]))
    assert_close(metrics["correction/weight_mean"], t(1.5))
    assert_close(metrics["scale"], torch.tensor(3.0))
    with pytest.raises(ValueError, match="does not take eps_clip"):
        check_policy_loss_hyperparams(scaled_pg, {"eps_clip": 0.2})


def test_registration_checks_signature_and_duplicates():
    with pytest.raises(TypeError, match="must accept keyword.*beta"):
        register_policy_loss("test_bad_signature", beta=1.0)(lambda *, logprobs, old_logprobs, advantages, mask: None)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("grpo")(POLICY_LOSSES["grpo"].fn)
    with pytest.raises(ValueError, match="sampler_logprobs is an input tensor"):
        register_policy_loss("test_bad_name", sampler_logprobs=None)
    assert "test_bad_signature" not in POLICY_LOSSES and "test_bad_name" not in POLICY_LOSSES


def test_only_variants_naming_sampler_logprobs_receive_them():
    # A variant gets `sampler_logprobs` (detached, 0 on masked-out tokens; or None) only if its
    # signature names it; a `**kwargs` variant and the TIS variants do not.
    seen = {}

    def record(key):
        def loss_fn(*, logprobs, advantages, sampler_logprobs=None, **kwargs):
            seen[key] = (sampler_logprobs, set(kwargs))
            return -logprobs * advantages, {}

        return loss_fn

    def kwargs_only(*, logprobs, advantages, **kwargs):
        seen["kwargs"] = set(kwargs)
        return -logprobs * advantages, {}

    register_policy_loss("test_sampler_tis")(record("tis"))
    register_policy_loss("test_sampler_plain", uses_tis=False)(record("plain"))
    register_policy_loss("test_sampler_kwargs", uses_tis=False)(kwargs_only)
    try:
        assert POLICY_LOSSES["test_sampler_tis"].takes_sampler_logprobs
        assert not POLICY_LOSSES["test_sampler_kwargs"].takes_sampler_logprobs
        assert not any(POLICY_LOSSES[n].takes_sampler_logprobs for n in BUILTIN if n != "reinforce")
        pi = leaf([[-1.0, -2.0]])
        sampler = pi + t([[-0.5, math.nan]])  # a live graph, nan on the masked-out token
        for name in ("test_sampler_tis", "test_sampler_plain", "test_sampler_kwargs"):
            run(name, pi=pi, sampler_logprobs=sampler, advantages=t([1.0]), mask=t([[1, 0]]))
        for key in ("tis", "plain"):
            received, others = seen[key]
            assert not received.requires_grad
            assert_close(received, t([[-1.5, 0.0]]))
        assert seen["tis"][1] == {"old_logprobs", "mask", "tis_weight"}
        assert seen["plain"][1] == {"old_logprobs", "mask"}
        assert seen["kwargs"] == {"old_logprobs", "mask"}
        run("test_sampler_plain", pi=pi, advantages=t([1.0]))
        assert seen["plain"][0] is None
    finally:
        for name in ("test_sampler_tis", "test_sampler_plain", "test_sampler_kwargs"):
            POLICY_LOSSES.pop(name, None)


def test_per_token_loss_is_zero_on_masked_tokens(name):
    x = random_inputs(7)
    loss_BT, _ = per_token_policy_loss(
        name, logprobs=x["pi"], old_logprobs=x["old"], sampler_logprobs=x["sampler"], ref_logprobs=x["ref"],
        advantages=x["advantages"], mask=x["mask"].bool(),
    )  # fmt: skip
    assert loss_BT.shape == x["pi"].shape
    assert torch.all(loss_BT[x["mask"] == 0] == 0)


# --------------------------------------------------------------------------- shipped configs


def test_conf_files_match_registry():
    # user.yaml is the base for a loss of the user's own module (its name is given on the CLI).
    files = {path.stem: path for path in CONF_DIR.glob("*.yaml") if path.stem != "user"}
    # Every built-in loss (other tests register losses of their own, without a file).
    assert set(files) == {
        n for n in available_policy_losses() if POLICY_LOSSES[n].fn.__module__.startswith("lit_grpo.")
    }
    for name, path in files.items():
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        assert cfg.pop("name") == name
        # luspo's length scaling is the paper's objective only under seq_mean ((1/B)·Σ |o|·ℓ); token_mean
        # would weigh each sequence by |o|² (tests/test_losses_luspo_vespo.py).
        assert cfg.pop("loss_normalization") == ("seq_mean" if name == "luspo" else "token_mean"), name
        cfg.update(cfg.pop("params"))  # a loss's own hyper-parameters: all of them, under `params`
        check_policy_loss_hyperparams(name, cfg)
        assert cfg == policy_loss_defaults(name), path.name
