"""The mismatch correction (`lit_grpo.maths.correction`): each mode against values worked out by
hand, an edge case each (a ratio exactly at a cap or a band edge, a sequence with no masked
token, no sampler logprobs), the off-policy mask, how a loss takes the correction, and the
`correction` config group.

Inputs are built as d = old − sampler = ln(r), in float64, with r chosen so that exp(ln r) == r
exactly (2, 4, 0.5, 0.25, 1.5): a ratio on an edge is on it, not a rounding away.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_config
from torch.testing import assert_close

from lit_grpo.config import ConfigError
from lit_grpo.maths.correction import (
    CORRECTIONS,
    correction_param_problems,
    correction_weights,
    kl_estimate,
    off_policy_mask,
    register_correction,
)
from lit_grpo.maths.losses import policy_loss
from lit_grpo.run.validate import validate

F64 = torch.float64
LN2 = math.log(2.0)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def weights(name, ratios, mask, **params):
    """(weight, masked, capped) for per-token ratios r = exp(old − sampler)."""
    old = torch.zeros(len(ratios), len(ratios[0]), dtype=F64)
    sampler = old - torch.log(t(ratios))
    return correction_weights(name, old_logprobs=old, sampler_logprobs=sampler, mask=t(mask), **params)


def test_registry_has_every_mode():
    assert {"none", "tis", "mask", "icepop", "geo_mask", "kl_reject"} <= set(CORRECTIONS)


def test_none_weighs_one():
    w, masked, capped = weights("none", [[4.0, 0.25]], [[1, 1]])
    assert_close(w, t([[1.0, 1.0]]))
    assert not masked.any() and not capped.any()


def test_tis_token_at_the_cap_is_not_capped():
    # r = [2, 4 (exactly the cap: kept, not capped), 8 -> 4 capped, (masked: 1)]; cap 4.
    w, masked, capped = weights("tis", [[2.0, 4.0, 8.0, 100.0]], [[1, 1, 1, 0]], level="token", cap=4.0)
    assert_close(w, t([[2.0, 4.0, 4.0, 1.0]]))
    assert capped.tolist() == [[False, False, True, False]]
    assert not masked.any()


def test_tis_sequence_uses_the_geometric_mean():
    # Sequence 0: r = [2, 8] -> exp((ln2 + ln8)/2) = 4 for both tokens; cap 5: kept.
    # Sequence 1: r = [4, 16] -> 8, capped at 5 on both tokens.
    w, _, capped = weights("tis", [[2.0, 8.0], [4.0, 16.0]], [[1, 1], [1, 1]], level="sequence", cap=5.0)
    assert_close(w, t([[4.0, 4.0], [5.0, 5.0]]))
    assert capped.tolist() == [[False, False], [True, True]]


def test_mask_token_drops_past_the_cap_and_keeps_the_cap():
    # cap 2: r = [1.5 -> 1.5, 2 (exactly the cap) -> 2, 4 -> 0 (dropped), (masked-out: 1)].
    w, masked, capped = weights("mask", [[1.5, 2.0, 4.0, 4.0]], [[1, 1, 1, 0]], level="token", cap=2.0)
    assert_close(w, t([[1.5, 2.0, 0.0, 1.0]]))
    assert masked.tolist() == [[False, False, True, False]]
    assert not capped.any()


def test_mask_sequence_drops_the_whole_sequence():
    # Sequence 0: geometric mean of [2, 8] is 4 > cap 3: both tokens dropped (weight 0).
    # Sequence 1: geometric mean of [2, 0.5] is 1: kept with weight 1.
    w, masked, _ = weights("mask", [[2.0, 8.0], [2.0, 0.5]], [[1, 1], [1, 1]], level="sequence", cap=3.0)
    assert_close(w, t([[0.0, 0.0], [1.0, 1.0]]))
    assert masked.tolist() == [[True, True], [False, False]]


def test_icepop_band_edges_are_kept():
    # band [0.5, 2]: r = [0.5 (edge) -> 0.5, 2 (edge) -> 2, 0.25 -> 0, 4 -> 0, 1.5 -> 1.5].
    w, masked, _ = weights("icepop", [[0.5, 2.0, 0.25, 4.0, 1.5]], [[1, 1, 1, 1, 1]], low=0.5, high=2.0)
    assert_close(w, t([[0.5, 2.0, 0.0, 0.0, 1.5]]))
    assert masked.tolist() == [[False, False, True, True, False]]


def test_geo_mask_band_and_an_empty_sequence():
    # Band [0.5, 2] on the geometric mean: seq 0 [4, 0.25] -> 1 kept (weight 1, not the ratio);
    # seq 1 [4, 4] -> 4 dropped; seq 2 has no masked token: nothing dropped, weight 1 (a
    # sequence of zero length has mean log-ratio 0).
    w, masked, _ = weights(
        "geo_mask", [[4.0, 0.25], [4.0, 4.0], [8.0, 8.0]], [[1, 1], [1, 1], [0, 0]], low=0.5, high=2.0
    )
    assert_close(w, t([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    assert masked.tolist() == [[False, False], [True, True], [False, False]]


def test_geo_mask_bounds_sampler_over_old_as_verl_seq_mean_k1():
    # verl's k1 is −d: the band bounds the geometric mean of sampler/old, the reciprocal of r.
    # Asymmetric band [0.5, 1], so the orientation decides (old/sampler = r shown):
    #   seq 0: r = [2, 2]  -> sampler/old 0.5, on the low edge: kept (old/sampler 2 would be dropped)
    #   seq 1: r = [0.5, 0.5] -> sampler/old 2 > 1: dropped (old/sampler 0.5 would be kept)
    #   seq 2: r = [4, 1]  -> geometric mean 2, sampler/old 0.5: kept
    w, masked, _ = weights("geo_mask", [[2.0, 2.0], [0.5, 0.5], [4.0, 1.0]], [[1, 1]] * 3, low=0.5, high=1.0)
    assert_close(w, t([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    assert masked.tolist() == [[False, False], [True, True], [False, False]]


def test_kl_estimates_by_hand():
    # d = old − sampler = [ln2, 0, −ln2]: k1 = |−d| = [ln2, 0, ln2]; k2 = d²/2 = [ln²2/2, 0, ln²2/2];
    # k3 = e^d − 1 − d = [1 − ln2, 0, ln2 − 1/2].
    d = t([[LN2, 0.0, -LN2]])
    mask = torch.ones_like(d)
    assert_close(kl_estimate(d, mask, "k1", "token"), t([[LN2, 0.0, LN2]]))
    assert_close(kl_estimate(d, mask, "k2", "token"), t([[LN2**2 / 2, 0.0, LN2**2 / 2]]))
    assert_close(kl_estimate(d, mask, "k3", "token"), t([[1 - LN2, 0.0, LN2 - 0.5]]))
    # Sequence k1: mean(−d) = 0, the signed terms cancel; sequence k3: (1 − ln2 + ln2 − 1/2)/3 = 1/6.
    assert_close(kl_estimate(d, mask, "k1", "sequence"), t([[0.0, 0.0, 0.0]]))
    assert_close(kl_estimate(d, mask, "k3", "sequence"), t([[1 / 6] * 3]))


def test_kl_reject_token_and_sequence():
    # r = [2, 1, 0.5], threshold 0.25. token k3 = [0.307, 0, 0.193]: the first dropped.
    # token k1 = [0.693, 0, 0.693]: both ends dropped. sequence k3 = 1/6 < 0.25: nothing dropped.
    ratios, mask = [[2.0, 1.0, 0.5]], [[1, 1, 1]]
    w, masked, _ = weights("kl_reject", ratios, mask, level="token", estimator="k3", threshold=0.25)
    assert_close(w, t([[0.0, 1.0, 1.0]]))
    w, _, _ = weights("kl_reject", ratios, mask, level="token", estimator="k1", threshold=0.25)
    assert_close(w, t([[0.0, 1.0, 0.0]]))
    w, masked, _ = weights("kl_reject", ratios, mask, level="sequence", estimator="k3", threshold=0.25)
    assert_close(w, t([[1.0, 1.0, 1.0]]))
    assert not masked.any()


def test_without_sampler_logprobs_every_mode_weighs_one():
    old = t([[-1.0, -2.0]])
    for name in ("tis", "mask", "icepop", "geo_mask", "kl_reject"):
        w, masked, capped = correction_weights(name, old_logprobs=old, sampler_logprobs=None, mask=t([[1, 1]]))
        assert_close(w, t([[1.0, 1.0]]))
        assert not masked.any() and not capped.any()


def test_padding_garbage_stays_out():
    old = t([[-1.0, math.nan]])
    sampler = t([[-1.0 - LN2, -math.inf]])
    w, masked, capped = correction_weights("mask", old_logprobs=old, sampler_logprobs=sampler, mask=t([[1, 0]]))
    assert_close(w, t([[2.0, 1.0]]))  # the sequence's mean over its one masked token: ln 2
    assert not masked.any() and not capped.any()


def test_off_policy_mask_by_hand():
    # behaviour − π per token; δ = 0.1. seq 0: mean 0.2 > δ and A < 0: dropped. seq 1: mean 0.1
    # (exactly δ: kept). seq 2: mean 0.5 but A > 0: kept. seq 3: mean −0.3, A < 0: kept.
    # seq 4: no masked token: nothing to drop.
    pi = torch.zeros(5, 2, dtype=F64)
    behaviour = t([[0.1, 0.3], [0.05, 0.15], [0.5, 0.5], [-0.3, -0.3], [9.0, 9.0]])
    advantages = t([-1.0, -1.0, 1.0, -1.0, -1.0])[:, None].expand(5, 2)
    mask = t([[1, 1], [1, 1], [1, 1], [1, 1], [0, 0]])
    dropped = off_policy_mask(logprobs=pi, behaviour_logprobs=behaviour, advantages=advantages, mask=mask, delta=0.1)
    assert dropped.tolist() == [[True, True], [False, False], [False, False], [False, False], [False, False]]


def test_a_dropped_token_keeps_its_place_in_the_normalizer():
    # importance_sampling on-policy (π = old), A = 1: L_t = −w_t. correction=mask, token, cap 3:
    # r = [2, 4] -> w = [2, 0]. token_mean over the 2 masked tokens: (−2 + 0)/2 = −1; the gradient
    # is −w/2 = [−1, 0]; masked_frac 1/2, weight_mean (2 + 0)/2 = 1.
    pi = t([[-1.0, -2.0]]).requires_grad_(True)
    sampler = pi.detach() - torch.log(t([[2.0, 4.0]]))
    loss, metrics = policy_loss(
        "importance_sampling", logprobs=pi, old_logprobs=pi.detach(), sampler_logprobs=sampler,
        advantages=t([1.0]), mask=t([[1, 1]]), normalization="token_mean",
        correction="mask", correction_params={"level": "token", "cap": 3.0},
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    assert_close(loss, t(-1.0))
    assert_close(grad, t([[-1.0, 0.0]]))
    assert_close(metrics["correction/masked_frac"], t(0.5))
    assert_close(metrics["correction/weight_mean"], t(1.0))


def test_reinforce_takes_the_drop_but_not_the_weight():
    # reinforce's ratio is to the sampler already: L_t = −exp(π − inf)·A. icepop [0.5, 2] with
    # old = π: r = [1.5 (kept, L = −1.5), 4 (dropped, L = 0)]; A = 1, sum normalization: −1.5.
    pi = t([[-1.0, -2.0]]).requires_grad_(True)
    sampler = pi.detach() - torch.log(t([[1.5, 4.0]]))
    loss, metrics = policy_loss(
        "reinforce", logprobs=pi, old_logprobs=pi.detach(), sampler_logprobs=sampler, advantages=t([1.0]),
        mask=t([[1, 1]]), normalization="sum", correction="icepop",
    )  # fmt: skip
    assert_close(loss, t(-1.5))
    assert "correction/weight_mean" not in metrics
    assert_close(metrics["correction/masked_frac"], t(0.5))


def test_off_policy_delta_in_the_loss():
    # importance_sampling on-policy, sum normalization, correction none. Two sequences of one token,
    # A = [−1, −1], sampler − π = [0.3, 0.0]: with δ = 0.1 the first is dropped: L = 0 + 1 = 1.
    pi = t([[-1.0], [-1.0]]).requires_grad_(True)
    sampler = pi.detach() + t([[0.3], [0.0]])
    common = dict(
        logprobs=pi, old_logprobs=pi.detach(), sampler_logprobs=sampler, advantages=t([-1.0, -1.0]),
        mask=t([[1], [1]]), normalization="sum", correction="none",
    )  # fmt: skip
    loss, metrics = policy_loss("importance_sampling", off_policy_delta=0.1, **common)
    assert_close(loss, t(1.0))
    assert_close(metrics["correction/off_policy_frac"], t(0.5))
    loss, _ = policy_loss("importance_sampling", **common)
    assert_close(loss, t(2.0))


def test_param_problems_name_the_parameter():
    assert correction_param_problems("tis", {"cap": 2.0, "level": "sequence"}) == []
    assert [k for k, _ in correction_param_problems("icepop", {"cap": 2.0})] == ["cap"]
    assert [k for k, _ in correction_param_problems("tis", {"level": "batch"})] == ["level"]
    assert [k for k, _ in correction_param_problems("kl_reject", {"estimator": "k4"})] == ["estimator"]
    assert [k for k, _ in correction_param_problems("icepop", {"low": 3.0, "high": 2.0})] == ["low"]
    assert [k for k, _ in correction_param_problems("mask", {"cap": 0.0})] == ["cap"]


def test_a_users_mode_from_the_registry():
    @register_correction("test_halve")
    def halve(log_ratio_BT, mask_BT):
        return (
            torch.full_like(log_ratio_BT, 0.5),
            torch.zeros_like(mask_BT, dtype=torch.bool),
            torch.zeros_like(mask_BT, dtype=torch.bool),
        )

    try:
        w, _, _ = weights("test_halve", [[4.0]], [[1]])
        assert_close(w, t([[0.5]]))
    finally:
        CORRECTIONS.pop("test_halve")


# --------------------------------------------------------------------------- the config group


@pytest.mark.parametrize("mode", ["none", "tis", "mask", "icepop", "geo_mask", "kl_reject"])
def test_every_option_composes_and_validates(mode):
    c = validate(compose_config(f"correction={mode}"))
    assert c.correction.name == mode


def test_default_is_tis_token_cap_5():
    c = validate(compose_config())
    assert (c.correction.name, c.correction.params()) == ("tis", {"level": "token", "cap": 5.0})


def test_a_parameter_the_mode_does_not_take_is_named():
    with pytest.raises(ConfigError, match=r"correction\.cap.*correction=icepop takes low, high"):
        validate(compose_config("correction=icepop", "correction.cap=2"))
    with pytest.raises(ConfigError, match=r"correction\.name.*unknown correction 'nope'"):
        validate(compose_config("correction.name=nope"))


def test_the_old_tis_names_are_the_correction_group(caplog):
    c = validate(compose_config("policy_loss.tis_cap=2.5", "policy_loss.tis_level=sequence"))
    assert (c.correction.name, c.correction.params()) == ("tis", {"level": "sequence", "cap": 2.5})
    assert "tis_cap" not in c.policy_loss.hyperparams()
    assert "policy_loss.tis_cap is now correction.cap" in caplog.text
    with pytest.raises(ConfigError, match=r"correction\.cap.*correction=icepop takes low, high"):
        validate(compose_config("policy_loss.tis_cap=2.5", "correction=icepop"))


# --------------------------------------------------------------------------- in the training loop


def _fit_shifted(tmp_path, monkeypatch, *overrides):
    """One step of the arithmetic experiment whose sampler logprobs are the trainer's minus 2 on
    every trained token (r = e² ≈ 7.39 everywhere), counting the no-gradient policy forwards."""
    import lit_grpo.loop.module
    import lit_grpo.rollouts.datamodule
    from lit_grpo.build import build_run

    monkeypatch.undo()  # a second call wraps the real functions, not the first call's wrappers
    real_make_batch = lit_grpo.rollouts.datamodule.make_batch
    real_no_grad = lit_grpo.loop.module.no_grad_logprobs
    forwards = []

    def shifted(*args, **kwargs):
        batch = real_make_batch(*args, **kwargs)
        batch.sampler_logprobs_BT = batch.sampler_logprobs_BT - 2.0 * batch.loss_mask_BT
        return batch

    def counted(*args, **kwargs):
        forwards.append(1)
        return real_no_grad(*args, **kwargs)

    monkeypatch.setattr(lit_grpo.rollouts.datamodule, "make_batch", shifted)
    monkeypatch.setattr(lit_grpo.loop.module, "no_grad_logprobs", counted)
    c = validate(
        compose_config(
            "+experiment=arithmetic", "trainer.fast_dev_run=2", "trainer.enable_progress_bar=false",
            "~callbacks.reward_filter", "batching.ppo_minibatches=2", "policy_loss.kl_beta=0",
            "batching.skip_zero_advantage_rows=false",  # the ratios below are means over every row
            *overrides,
            output_dir=tmp_path,
        )
    )  # fmt: skip
    trainer, module, datamodule = build_run(c)
    trainer.fit(module, datamodule=datamodule)
    [step] = module.step_sequence.history.steps
    return step, len(forwards)


@pytest.mark.timeout(300)
def test_anchor_on_the_rollout_skips_the_old_forward(tmp_path, monkeypatch):
    # old_policy: `old` is a forward of the policy before the update, so the ratio π/old starts at 1
    # and the correction sees r = e² > cap 5 on every token: weight 5, all capped.
    step, forwards = _fit_shifted(tmp_path / "old", monkeypatch)
    assert forwards == 1
    assert step["train/ratio_mean"] == pytest.approx(1.0, abs=0.05)
    assert step["train/correction/weight_mean"] == pytest.approx(5.0)
    assert step["train/correction/capped_frac"] == pytest.approx(1.0)
    # rollout: no such forward; `old` is the sampler's logprobs, so the ratio is π/π_sampler ≈ e²
    # (the first minibatch exactly, the second after one small update) and the correction is identity.
    step, forwards = _fit_shifted(tmp_path / "rollout", monkeypatch, "policy_loss.anchor_logp=rollout")
    assert forwards == 0
    assert step["train/ratio_mean"] == pytest.approx(math.exp(2.0), rel=0.02)
    assert step["train/correction/weight_mean"] == pytest.approx(1.0)
    assert step["train/correction/capped_frac"] == 0.0
    assert step["train/drift/k1"] == pytest.approx(-2.0, abs=0.05)  # the drift is still the trainer's vs the sampler's
