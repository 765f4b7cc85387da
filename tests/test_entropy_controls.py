"""Entropy controls: the differentiated entropy (against autograd of the naive formula), the bonus
in the loss, its decay and its adaptive coefficient, the top-entropy token mask, the alarm, the
config, and a run whose adaptive coefficient survives a resume.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import compose_config, trained_steps
from torch.testing import assert_close

from lit_grpo.config import ConfigError, EntropyConfig, ineffective_knobs
from lit_grpo.loop.entropy_control import EntropyControl
from lit_grpo.maths.entropy import adapted_entropy_coef, scheduled_entropy_coef, top_entropy_mask
from lit_grpo.maths.logprobs import selected_logprobs_and_entropy
from lit_grpo.maths.losses import policy_loss
from lit_grpo.run.validate import validate
from lit_grpo.train import train

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_entropy_gradient_matches_autograd_of_the_naive_formula(temperature, chunk_rows):
    # d/dz of Σ g_sel·logp(target) + Σ g_H·H, with H = −Σ p log p of softmax(z / T): autograd of the
    # plain formula is the independent reference.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 31, generator=g) * 3).requires_grad_(True)
    targets = torch.randint(0, 31, (3, 5), generator=g)
    g_sel, g_H = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    selected, entropy = selected_logprobs_and_entropy(logits, targets, temperature, chunk_rows, entropy_grad=True)
    assert entropy.requires_grad
    ((g_sel * selected).sum() + (g_H * entropy).sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits / temperature, dim=-1)
    naive_entropy = -(logp.exp() * logp).sum(-1)
    ((g_sel * logp.gather(-1, targets[..., None])[..., 0]).sum() + (g_H * naive_entropy).sum()).backward()
    assert_close(entropy.detach(), naive_entropy.detach(), atol=1e-5, rtol=1e-5)
    assert_close(got, logits.grad, atol=1e-6, rtol=1e-5)
    # The entropy's term alone (no logprob used) still reaches the logits.
    logits.grad = None
    _, entropy = selected_logprobs_and_entropy(logits, targets, temperature, chunk_rows, entropy_grad=True)
    entropy.sum().backward()
    assert logits.grad.abs().sum() > 0


def test_entropy_is_detached_by_default():
    logits = torch.randn(1, 2, 5, requires_grad=True)
    _, entropy = selected_logprobs_and_entropy(logits, torch.zeros(1, 2, dtype=torch.long))
    assert not entropy.requires_grad


def test_bonus_in_the_loss_by_hand():
    # importance_sampling on-policy, A = 0 (the policy term vanishes), correction none, sum
    # normalization: L = −coef·Σ m_t·H_t = −0.1·(2 + 3) = −0.5 (the masked-out H = 100 stays out);
    # dL/dH = −0.1 on the masked tokens, 0 on the other.
    pi = t([[-1.0, -1.0, -1.0]]).requires_grad_(True)
    entropy = t([[2.0, 3.0, 100.0]]).requires_grad_(True)
    loss, _ = policy_loss(
        "importance_sampling", logprobs=pi, old_logprobs=pi.detach(), advantages=t([0.0]), mask=t([[1, 1, 0]]),
        normalization="sum", correction="none", entropy=entropy, entropy_coef=0.1,
    )  # fmt: skip
    assert_close(loss, t(-0.5))
    (grad,) = torch.autograd.grad(loss, entropy)
    assert_close(grad, t([[-0.1, -0.1, 0.0]]))


def test_top_entropy_quantile_in_the_loss_by_hand():
    # importance_sampling on-policy, A = 1: L_t = −1 per kept token. Entropies [1, 2, 3, 4], q = 0.5:
    # the 0.5 quantile is 2.5, so tokens 3 and 4 train: sum −2; kept_frac 1/2. token_mean keeps the
    # 4 tokens in the denominator: −2/4 = −0.5.
    pi = t([[-1.0, -1.0, -1.0, -1.0]]).requires_grad_(True)
    common = dict(
        logprobs=pi, old_logprobs=pi.detach(), advantages=t([1.0]), mask=t([[1, 1, 1, 1]]), correction="none",
        entropy=t([[1.0, 2.0, 3.0, 4.0]]), top_entropy_quantile=0.5,
    )  # fmt: skip
    loss, metrics = policy_loss("importance_sampling", normalization="sum", **common)
    assert_close(loss, t(-2.0))
    assert_close(metrics["entropy/kept_frac"], t(0.5))
    loss, _ = policy_loss("importance_sampling", normalization="token_mean", **common)
    assert_close(loss, t(-0.5))


def test_top_entropy_mask_edges():
    # [1, 2, 3, 4, 5] and a masked-out 100: q = 0.4 -> the 0.6 quantile, 1 + 0.6·4 = 3.4: keep 4, 5.
    entropy = t([[1.0, 2.0, 3.0, 4.0, 5.0, 100.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    assert top_entropy_mask(entropy, mask, 0.4).tolist() == [[False, False, False, True, True, False]]
    assert top_entropy_mask(entropy, mask, 1.0).tolist() == [[True] * 5 + [False]]  # q = 1: every masked token
    assert not top_entropy_mask(entropy, torch.zeros_like(mask), 0.5).any()  # a zero-length mask keeps none
    ties = t([[1.0, 1.0, 1.0, 1.0]])
    assert top_entropy_mask(ties, torch.ones_like(ties), 0.25).all()  # ties at the threshold are kept
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        top_entropy_mask(entropy, mask, 0.0)


def test_scheduled_coef_decays_linearly_then_holds():
    # 0.01 -> 0.002 over 8 steps: step 2 is a quarter of the way, 0.01 − 0.25·0.008 = 0.008.
    at = [scheduled_entropy_coef(s, coef=0.01, coef_final=0.002, decay_steps=8) for s in (0, 2, 8, 100)]
    assert at == pytest.approx([0.01, 0.008, 0.002, 0.002])
    assert scheduled_entropy_coef(5, coef=0.01, coef_final=None, decay_steps=8) == 0.01


def test_adapted_coef_moves_by_its_step_within_bounds():
    assert adapted_entropy_coef(0.01, 0.5, target=1.0, step_size=0.002, coef_max=0.05) == pytest.approx(0.012)
    assert adapted_entropy_coef(0.01, 1.5, target=1.0, step_size=0.002, coef_max=0.05) == pytest.approx(0.008)
    assert adapted_entropy_coef(0.001, 1.5, target=1.0, step_size=0.002, coef_max=0.05) == 0.0  # floor 0
    assert adapted_entropy_coef(0.049, 0.5, target=1.0, step_size=0.002, coef_max=0.05) == 0.05  # ceiling
    assert adapted_entropy_coef(0.01, 1.0, target=1.0, step_size=0.002, coef_max=0.05) == pytest.approx(0.008)


def test_alarm_warns_once_and_logs_every_step(caplog):
    control = EntropyControl(EntropyConfig(floor=0.5, ceiling=3.0))
    with caplog.at_level(logging.WARNING):
        seen = [control.after_step(h, warn=True)["train/entropy_alarm"] for h in (1.0, 0.4, 0.3, 3.0, 3.5)]
    assert seen == [0.0, 1.0, 1.0, 0.0, 1.0]  # the floor and the ceiling are themselves inside
    assert caplog.text.count("mean entropy") == 1 and "below entropy.floor" in caplog.text


def test_adaptive_control_state_round_trips():
    control = EntropyControl(EntropyConfig(coef=0.01, target=1.0, adapt_step=0.002))
    metrics = control.after_step(0.5, warn=False)
    assert metrics == {"train/entropy/coef": 0.01} and control.coef(7) == pytest.approx(0.012)
    other = EntropyControl(EntropyConfig(coef=0.01, target=1.0, adapt_step=0.002))
    other.load_state_dict(control.state_dict())
    assert other.coef(0) == pytest.approx(0.012)


def test_config_checks_name_the_field():
    for overrides, field in (
        (["entropy.coef=-1"], "entropy.coef"),
        (["entropy.top_quantile=0"], "entropy.top_quantile"),
        (["entropy.floor=2", "entropy.ceiling=1"], "entropy.floor"),
        (["entropy.target=1", "entropy.decay_steps=5", "entropy.coef_final=0"], "entropy.decay_steps"),
        (["entropy.target=1", "entropy.coef=0.1", "entropy.coef_max=0.01"], "entropy.coef_max"),
        (["entropy.coef=nan"], "entropy.coef"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(compose_config(*overrides))
    knobs = ineffective_knobs(validate(compose_config("entropy.coef_final=0", "entropy.adapt_step=0.01")))
    assert any("entropy.coef_final=0.0 has no effect alone" in k for k in knobs)
    assert any("entropy.adapt_step=0.01 has no effect without entropy.target" in k for k in knobs)


# --------------------------------------------------------------------------- in a run


def _run(tmp_path, *overrides):
    c = compose_config(
        "+experiment=arithmetic", "trainer.enable_progress_bar=false", "~callbacks.reward_filter",
        "entropy.target=10", "entropy.coef=0.0", "entropy.adapt_step=0.01", "entropy.floor=5",
        *overrides, output_dir=tmp_path,
    )  # fmt: skip
    train(c)
    return trained_steps(tmp_path)


@pytest.mark.timeout(600)
def test_adaptive_coef_rises_and_survives_a_resume(tmp_path):
    # The tiny policy's entropy (about 3.1 nats) is below the target 10, so the coefficient rises
    # by 0.01 a step from 0: 0, 0.01, 0.02, 0.03 are the coefficients steps 1-4 train with. Resumed
    # from the step-2 checkpoint, steps 3 and 4 must train with 0.02 and 0.03 again, to the same losses.
    whole = _run(tmp_path / "whole", "max_steps=4", "checkpoint.save_interval=2")
    assert [row["train/entropy/coef"] for row in whole] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    assert all(row["train/entropy_alarm"] == 1.0 for row in whole)  # below the floor of 5
    # The bonus is in the loss: the loss of step 2 is lower than step 1's by about 0.01·H ≈ 0.03.
    assert whole[1]["train/loss"] < whole[0]["train/loss"] - 0.005
    [step_2] = [p for p in (tmp_path / "whole" / "checkpoints").iterdir() if p.name.endswith("2")]
    resumed = _run(tmp_path / "resumed", "max_steps=4", "checkpoint.save_interval=2", f"resume={step_2}")
    assert [row["train/entropy/coef"] for row in resumed][-2:] == pytest.approx([0.02, 0.03])
    assert [row["train/loss"] for row in resumed][-2:] == [row["train/loss"] for row in whole][-2:]
    assert math.isfinite(resumed[-1]["train/entropy"])
