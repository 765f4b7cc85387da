"""The step reads as the step: `training_step` and `_optimizer_step` stay short, the loss takes its
settings as one object built once from the config, and that object gives the loss exactly what
the keyword form does."""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from conftest import compose_config

from lit_grpo.loop.module import GRPOModule
from lit_grpo.loop.optimizer_step import loss_settings
from lit_grpo.maths.losses import LossSettings, policy_loss, policy_loss_with
from lit_grpo.run.validate import validate

STEP_LINES_AT_MOST = 120
LOSS_TENSORS = {
    "logprobs",
    "old_logprobs",
    "sampler_logprobs",
    "ref_logprobs",
    "advantages",
    "mask",
    "entropy",
    "num_tokens",
    "num_sequences",
}
"""What the step hands the loss besides its settings: tensors and the step's normalizers."""


def _lines(fn) -> int:
    return len(inspect.getsource(fn).splitlines())


def test_the_step_and_the_optimizer_step_together_stay_under_120_lines():
    lines = _lines(GRPOModule.training_step) + _lines(GRPOModule._optimizer_step)
    assert lines < STEP_LINES_AT_MOST, lines


def test_the_loss_call_takes_one_settings_object():
    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOModule._optimizer_step)))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("policy_loss", "policy_loss_with")
    ]
    assert len(calls) == 1 and calls[0].func.id == "policy_loss_with"
    (call,) = calls
    assert len(call.args) == 1, "the settings, and nothing else, positionally"
    keywords = {k.arg for k in call.keywords}
    assert None not in keywords, "no **kwargs: the settings object carries the loss's options"
    assert keywords <= LOSS_TENSORS, keywords - LOSS_TENSORS


def test_the_settings_are_read_from_the_config_in_one_place(tmp_path):
    c = validate(
        compose_config(
            "policy_loss=dapo",
            "policy_loss.eps_clip_c=3.0",
            "policy_loss.loss_normalization=seq_mean",
            "correction=icepop",
            "correction.low=0.25",
            "correction.off_policy_delta=0.1",
            "entropy.top_quantile=0.2",
            "entropy.coef=0.01",
            output_dir=tmp_path,
        )
    )
    settings = loss_settings(c)
    assert settings == LossSettings(
        name="dapo",
        hyperparams=c.policy_loss.hyperparams(),
        normalization="seq_mean",
        correction="icepop",
        correction_params=c.correction.params(),
        off_policy_delta=0.1,
        top_entropy_quantile=0.2,
        entropy_coef=0.01,
    )
    assert settings.correction_params["low"] == 0.25 and settings.hyperparams["eps_clip_c"] == 3.0
    assert settings.kl_beta == c.policy_loss.kl_beta
    assert settings.with_entropy_coef(0.5).entropy_coef == 0.5 and settings.entropy_coef == 0.01  # frozen


def test_the_settings_give_the_loss_exactly_what_the_keywords_do():
    g = torch.Generator().manual_seed(0)
    pi = torch.randn(3, 6, generator=g, dtype=torch.float64).clamp(max=-0.01).requires_grad_()
    tensors = dict(
        old_logprobs=pi.detach() + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64),
        sampler_logprobs=pi.detach() + 0.2 * torch.randn(3, 6, generator=g, dtype=torch.float64),
        ref_logprobs=pi.detach() - 0.3,
        advantages=torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
        mask=torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float64),
        entropy=torch.rand(3, 6, generator=g, dtype=torch.float64),
        num_tokens=torch.tensor(13.0, dtype=torch.float64),
        num_sequences=torch.tensor(3.0, dtype=torch.float64),
    )
    settings = LossSettings(
        name="dapo",
        hyperparams={"kl_beta": 0.05, "eps_clip_c": 3.0},
        normalization="token_mean",
        correction="tis",
        correction_params={"cap": 1.5, "level": "sequence"},
        off_policy_delta=0.05,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
    )
    loss, metrics = policy_loss_with(settings, logprobs=pi, **tensors)
    (grad,) = torch.autograd.grad(loss, pi)
    want, want_metrics = policy_loss(
        "dapo", logprobs=pi, **tensors, normalization="token_mean", correction="tis",
        correction_params={"cap": 1.5, "level": "sequence"}, off_policy_delta=0.05, top_entropy_quantile=0.5,
        entropy_coef=0.01, kl_beta=0.05, eps_clip_c=3.0,
    )  # fmt: skip
    (want_grad,) = torch.autograd.grad(want, pi)
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)
    assert metrics.keys() == want_metrics.keys() and all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
