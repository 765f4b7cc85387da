"""GRPOModule: one step trains the policy and never the reference; logprobs line up with tokens."""

import lightning as L
import torch

from lit_grpo.run.validate import validate
from lit_grpo.loop.module import token_logprobs
from lit_grpo.build import build_run

from conftest import compose_config


def _build(tmp_path, *overrides):
    c = validate(compose_config("+experiment=arithmetic", "trainer.fast_dev_run=1", "trainer.enable_progress_bar=false", *overrides, output_dir=tmp_path))
    return build_run(c)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_step_changes_the_policy_and_not_the_reference(tmp_path):
    trainer, module, datamodule = _build(tmp_path, "policy_loss.kl_beta=0.5")
    assert module.reference is not None
    assert not any(p.requires_grad for p in module.reference.parameters())
    policy_before, reference_before = _snapshot(module.policy), _snapshot(module.reference)

    trainer.fit(module, datamodule=datamodule)

    history = module.step_sequence.history
    assert len(history.steps) == 1
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, policy_before[k])]
    assert changed, "a training step left every policy parameter unchanged"
    for k, v in module.reference.state_dict().items():
        assert torch.equal(v, reference_before[k]), f"reference parameter {k} changed"
    assert not module.reference.training
    optimizer_params = {id(p) for group in module.trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimizer_params & {id(p) for p in module.reference.parameters()}
    assert "train/ref_kl" in history.steps[0]


def test_no_reference_without_kl(tmp_path):
    _, module, _ = _build(tmp_path, "policy_loss.kl_beta=0")
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


def test_micro_batches_accumulate_to_the_whole_batch_step(tmp_path):
    # token_mean divides by the tokens of the whole optimizer step, so splitting the batch into
    # micro-batches must give the same gradient as one forward over everything.
    class GradCapture(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads = {k: p.grad.detach().clone() for k, p in pl_module.policy.named_parameters()}

    grads = []
    for micro in (0, 3):
        trainer, module, datamodule = _build(tmp_path / str(micro), "~callbacks.reward_filter", f"micro_batch_size={micro}", "sampler.max_completion_tokens=3", "grad_clip_norm=0")
        capture = GradCapture()
        trainer.callbacks.append(capture)
        trainer.fit(module, datamodule=datamodule)
        grads.append(capture.grads)
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-4)


def test_ppo_minibatches_make_k_optimizer_steps(tmp_path):
    trainer, module, datamodule = _build(tmp_path, "ppo_n_minibatches=4", "~callbacks.reward_filter")
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 4
