"""GRPOModule: one step trains the policy and never the reference; logprobs line up with tokens."""

import torch

from lit_grpo.callbacks.history import MetricHistory
from lit_grpo.config import validate
from lit_grpo.models import load_policy, load_tokenizer
from lit_grpo.module import token_logprobs
from lit_grpo.train import build_datamodule, build_module, build_trainer

from conftest import compose_config


def _build(tmp_path, *overrides):
    c = validate(compose_config("+experiment=arithmetic", "trainer.fast_dev_run=1", "trainer.enable_progress_bar=false", *overrides, output_dir=tmp_path))
    tokenizer = load_tokenizer(c.model)
    policy = load_policy(c.model, tokenizer, c.seed)
    return c, build_datamodule(c, policy, tokenizer), build_module(c, policy)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_step_changes_the_policy_and_not_the_reference(tmp_path):
    c, datamodule, module = _build(tmp_path, "policy_loss.kl_beta=0.5")
    assert module.reference is not None
    assert not any(p.requires_grad for p in module.reference.parameters())
    policy_before, reference_before = _snapshot(module.policy), _snapshot(module.reference)

    history = MetricHistory()
    build_trainer(c, history).fit(module, datamodule=datamodule)

    assert len(history.steps) == 1
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, policy_before[k])]
    assert changed, "a training step left every policy parameter unchanged"
    for k, v in module.reference.state_dict().items():
        assert torch.equal(v, reference_before[k]), f"reference parameter {k} changed"
    assert not module.reference.training
    optimizer_params = {id(p) for group in module.trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimizer_params & {id(p) for p in module.reference.parameters()}
    assert "kl/ref" in history.steps[0]


def test_no_reference_without_kl(tmp_path):
    _, _, module = _build(tmp_path, "policy_loss.kl_beta=0")
    assert module.reference is None
    assert not any("reference" in name for name, _ in module.named_modules())


def test_token_logprobs_align_with_next_tokens(tiny_model, tokenizer):
    # Position t of the output must be log p(token t+1 | tokens <= t): compare with a manual forward.
    tokens = torch.tensor([tokenizer("12+3=15", add_special_tokens=False)["input_ids"]])
    attention = torch.ones_like(tokens)
    logprobs, entropy = token_logprobs(tiny_model, tokens, attention, temperature=0.5)
    logits = tiny_model(input_ids=tokens).logits[0]
    for t in range(tokens.shape[1] - 1):
        expected = torch.log_softmax(logits[t] / 0.5, -1)[tokens[0, t + 1]]
        torch.testing.assert_close(logprobs[0, t], expected)
    assert logprobs.shape == entropy.shape == (1, tokens.shape[1] - 1)
    assert (entropy > 0).all()
