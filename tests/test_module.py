"""GRPOModule: one step trains the policy and never the reference; logprobs line up with tokens."""

import copy

import lightning as L
import pytest
import torch
from conftest import compose_config

from lit_grpo.build import build_run
from lit_grpo.loop.module import token_logprobs
from lit_grpo.maths.logprobs import first_scored_prediction
from lit_grpo.maths.loss_terms import LOSS_NORMALIZATIONS
from lit_grpo.maths.losses import policy_loss_with
from lit_grpo.run.validate import validate


def _build(tmp_path, *overrides):
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "trainer.fast_dev_run=1",
            "trainer.enable_progress_bar=false",
            *overrides,
            output_dir=tmp_path,
        )
    )
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


@pytest.mark.parametrize("normalization", list(LOSS_NORMALIZATIONS))
def test_micro_batches_accumulate_to_the_whole_batch_step(tmp_path, normalization):
    # Every normalization divides by counts of the whole optimizer step (token_mean: its masked
    # tokens, seq_mean: its sequences; sum: nothing), so splitting the batch into micro-batches
    # (of 1, and of 3: 2 groups of 8 rows leave a last one of 1) must give the gradient of one
    # forward over everything. Completions of up to 3 tokens make the sequences' token counts
    # differ (one of the 16 has 2), so seq_mean is not token_mean; the reward filter keeps only
    # groups with a learning signal (non-zero advantages: at step 1 the KL term has no gradient).
    class GradCapture(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads = {k: p.grad.detach().clone() for k, p in pl_module.policy.named_parameters()}

    grads = []
    for micro in (0, 1, 3):
        trainer, module, datamodule = _build(
            tmp_path / str(micro),
            f"batching.micro_batch_size={micro}",
            "sampler.max_completion_tokens=3",
            "optim.grad_clip_norm=0",
            f"policy_loss.loss_normalization={normalization}",
            "data.prompt_groups_per_step=2",
            "data.completions_per_prompt=8",
        )
        assert module.config.policy_loss.loss_normalization == normalization
        capture = GradCapture()
        trainer.callbacks.append(capture)
        trainer.fit(module, datamodule=datamodule)
        grads.append(capture.grads)
    whole = grads[0]
    assert sum(g.abs().sum() for g in whole.values()) > 0
    scale = max(g.abs().max() for g in whole.values()).item()  # `sum` has gradients far above 1
    for micro, split in zip((1, 3), grads[1:]):
        worst = max((whole[k] - split[k]).abs().max().item() for k in whole)
        assert worst <= 1e-6 * max(1.0, scale), (micro, worst, scale)


def test_ppo_minibatches_make_k_optimizer_steps(tmp_path):
    trainer, module, datamodule = _build(tmp_path, "batching.ppo_minibatches=4", "~callbacks.reward_filter")
    trainer.fit(module, datamodule=datamodule)
    # Each minibatch is one optimizer step: taken (Lightning counts it), or skipped for want of signal
    # (a minibatch whose groups' rewards are all equal, no filter here); the schedule counts the taken ones.
    (step,) = module.step_sequence.history.steps
    assert trainer.global_step + step["train/skipped_no_signal"] == 4
    assert module.lr_schedulers().last_epoch == trainer.global_step


def test_ppo_old_logprobs_are_the_policy_before_the_first_minibatch(tmp_path, monkeypatch):
    # `old` is the policy before the batch's first update, computed once: minibatch 1 trains at
    # ratio exp(π - old) = 1, minibatch 2 (after minibatch 1's optimizer step) at a ratio != 1,
    # and both minibatches' `old` are the initial policy's logprobs of their rows.
    import lit_grpo.loop.module as module_py

    calls, forwards = [], []

    def recording_loss(settings, **kwargs):
        calls.append({k: kwargs[k].detach().clone() for k in ("logprobs", "old_logprobs", "sampler_logprobs", "mask")})
        return policy_loss_with(settings, **kwargs)

    def recording_logprobs(model, tokens, attention, temperature, first_scored=0, **kwargs):
        if torch.is_grad_enabled():  # the training forwards, one per minibatch here (no micro-batches)
            forwards.append((tokens.clone(), attention.clone()))
        return token_logprobs(model, tokens, attention, temperature, first_scored, **kwargs)

    monkeypatch.setattr(module_py, "policy_loss_with", recording_loss)
    monkeypatch.setattr(module_py, "token_logprobs", recording_logprobs)
    trainer, module, datamodule = _build(
        tmp_path,
        "batching.ppo_minibatches=2",
        "~callbacks.reward_filter",
        "policy_loss.kl_beta=0",
        "batching.micro_batch_size=0",
        "batching.share_prefixes=false",  # bitwise below: the same forward, each row whole (sharing rounds apart)
        "batching.skip_zero_advantage_rows=false",  # every row's `old`, those of advantage 0 too
    )
    initial = copy.deepcopy(module.policy)
    trainer.fit(module, datamodule=datamodule)

    assert trainer.global_step == 2 and len(calls) == 2 and len(forwards) == 2
    # The initial policy's logprobs of the whole batch, in one forward as the module's `old` pass
    # (the LM head from the first column any row trains on, as there).
    tokens, attention = (torch.cat(parts) for parts in zip(*forwards))
    first = first_scored_prediction(torch.cat([call["mask"] for call in calls]))
    assert first > 0  # the prompts are skipped
    with torch.no_grad():
        want_old = token_logprobs(
            initial, tokens, attention, module.config.sampler.temperature, first, padding_free=module.padding_free
        )[0]
    half = tokens.shape[0] // 2
    assert torch.equal(calls[0]["old_logprobs"], want_old[:half])
    assert torch.equal(calls[1]["old_logprobs"], want_old[half:])

    def ratio_gap(call):  # max |exp(π - old) - 1| over the loss-masked tokens
        m = call["mask"] > 0
        assert m.sum() > 0
        return (call["logprobs"] - call["old_logprobs"]).exp()[m].sub(1).abs().max().item()

    assert ratio_gap(calls[0]) < 1e-6  # nothing has moved the policy yet
    assert ratio_gap(calls[1]) > 1e-3  # minibatch 1's step did, and `old` did not follow it
    # The sampler drew with the same initial weights: its logprobs are `old` (up to kernels).
    for call in calls:
        m = call["mask"] > 0
        torch.testing.assert_close(call["sampler_logprobs"][m], call["old_logprobs"][m], atol=1e-5, rtol=0)
