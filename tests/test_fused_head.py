"""The fused LM head: the same logprobs, entropy and gradients as full logits through the naive formula,
and no `[rows, T, V]` tensor on the way."""

import copy
from pathlib import Path

import pytest
import torch
from conftest import compose_config, lora_policy_that_moves
from torch.utils._python_dispatch import TorchDispatchMode

import lit_grpo
from lit_grpo.build import build_run
from lit_grpo.config import LoraConfig, ModelConfig
from lit_grpo.maths.head_logprobs import (
    FUSED_CHUNK_BYTES,
    fused_token_logprobs,
    head_logprobs_and_entropy,
    split_lm_head,
)
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.maths.softmax_chunks import default_chunk_rows
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model
from lit_grpo.models.lora import AdapterFreeView, apply_lora
from lit_grpo.run.validate import validate

FLOAT32 = {"atol": 2e-6, "rtol": 2e-6}


def assert_float32_close(value, expected, name=""):
    """Float32 agreement up to rounding: 1e-5 relative, or 1e-6 of the tensor's largest entry (sums of
    many terms, such as a hidden state's gradient over V logits, round near zero too)."""
    atol = 1e-6 * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(value, expected, atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def naive(hidden_NH, weight_VH, bias_V, targets_N, temperature):
    """Full logits -> log_softmax -> gather, and the entropy, all differentiable: [N, H] -> ([N], [N])."""
    logits_NV = torch.nn.functional.linear(hidden_NH, weight_VH, bias_V)
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    return logp_NV.gather(-1, targets_N[:, None])[:, 0], -(logp_NV.exp() * logp_NV).sum(-1)


def _inputs(N, H, V, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden_NH = (torch.randn(N, H, generator=g) * 2).to(dtype).requires_grad_(True)
    weight_VH = torch.randn(V, H, generator=g).to(dtype).requires_grad_(True)
    bias_V = torch.randn(V, generator=g).to(dtype).requires_grad_(True) if bias else None
    targets_N = torch.randint(0, V, (N,), generator=g)
    # Signed loss weights, some zero (masked tokens), for the logprob and for the entropy.
    weights_N = torch.randn(N, generator=g) * (torch.rand(N, generator=g) > 0.2)
    entropy_weights_N = torch.randn(N, generator=g)
    return hidden_NH, weight_VH, bias_V, targets_N, weights_N, entropy_weights_N


def _values_and_grads(fn, hidden_NH, weight_VH, bias_V, targets_N, weights_N, entropy_weights_N, entropy_grad):
    """Logprobs, entropy, and the gradients of sum(w·logprob) (+ sum(w_H·entropy)) to hidden, weight, bias."""
    leaves = [t for t in (hidden_NH, weight_VH, bias_V) if t is not None]
    for t in leaves:
        t.grad = None
    logprobs_N, entropy_N = fn(hidden_NH, weight_VH, bias_V, targets_N)
    loss = (weights_N * logprobs_N).sum()
    if entropy_grad:
        loss = loss + (entropy_weights_N * entropy_N).sum()
    loss.backward()
    return [logprobs_N.detach(), entropy_N.detach(), *(t.grad.clone() for t in leaves)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 17, 64, None])  # N = 17: divides, does not, one chunk, more
def test_float32_values_and_gradients_match_the_naive_formula(chunk_rows, temperature, entropy_grad):
    inputs = _inputs(17, 12, 97, torch.float32, bias=True)
    got = _values_and_grads(
        lambda h, w, b, t: head_logprobs_and_entropy(h, w, b, t, temperature, chunk_rows, entropy_grad),
        *inputs,
        entropy_grad,
    )
    want = _values_and_grads(lambda h, w, b, t: naive(h, w, b, t, temperature), *inputs, entropy_grad)
    for name, value, expected in zip(("logprobs", "entropy", "hidden", "weight", "bias"), got, want):
        assert_float32_close(value, expected, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_one_chunk_is_not_recomputed_in_the_backward_and_a_second_backward_still_is(monkeypatch, entropy_grad):
    # All 17 rows in one chunk: the forward computes the logits once and the backward reuses their
    # log-softmax (three matmuls, not four). A second backward of the same graph (retain_graph)
    # recomputes them, and both give the same gradients.
    from lit_grpo.maths import head_logprobs

    calls = []
    original = head_logprobs._scaled_chunk_logits
    monkeypatch.setattr(head_logprobs, "_scaled_chunk_logits", lambda *a: calls.append(1) or original(*a))
    hidden_NH, weight_VH, bias_V, targets_N, weights_N, entropy_weights_N = _inputs(17, 8, 50, torch.float32, True)
    logprobs_N, entropy_N = head_logprobs_and_entropy(hidden_NH, weight_VH, bias_V, targets_N, 0.7, 64, entropy_grad)
    loss = (weights_N * logprobs_N).sum() + ((entropy_weights_N * entropy_N).sum() if entropy_grad else 0.0)
    assert len(calls) == 1
    grads = torch.autograd.grad(loss, (hidden_NH, weight_VH, bias_V), retain_graph=True)
    assert len(calls) == 1  # the kept log-softmax: no second head matmul
    again = torch.autograd.grad(loss, (hidden_NH, weight_VH, bias_V))
    assert len(calls) == 2  # recomputed
    expected = _values_and_grads(
        lambda h, w, b, t: naive(h, w, b, t, 0.7), hidden_NH, weight_VH, bias_V, targets_N, weights_N,
        entropy_weights_N, entropy_grad,
    )[2:]  # fmt: skip
    for name, kept, recomputed, want in zip(("hidden", "weight", "bias"), grads, again, expected):
        assert_float32_close(kept, want, name)
        assert_float32_close(recomputed, kept, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bfloat16_matches_the_naive_formula_loosely(temperature, entropy_grad):
    inputs = _inputs(21, 16, 131, torch.bfloat16, bias=False, seed=3)
    got = _values_and_grads(
        lambda h, w, b, t: head_logprobs_and_entropy(h, w, b, t, temperature, 5, entropy_grad), *inputs, entropy_grad
    )
    want = _values_and_grads(lambda h, w, b, t: naive(h, w, b, t, temperature), *inputs, entropy_grad)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    # Same bf16 logits (the same matmul per row), the softmax in float32: the values agree closely.
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    # The gradients: bf16 matmuls, the weight's summed over chunks in float32 (naive: one bf16 matmul).
    for value, expected in zip(got[2:], want[2:]):
        scale = expected.float().abs().max()
        torch.testing.assert_close(value.float(), expected.float(), atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.timeout(60)
def test_a_wrong_gradient_would_be_caught():
    # Guard on the tolerances above: the untempered gradient, or one 1e-4 off, must fail them.
    inputs = _inputs(9, 8, 53, torch.float32, bias=False)
    got = _values_and_grads(lambda h, w, b, t: head_logprobs_and_entropy(h, w, b, t, 0.6, 4), *inputs, False)
    untempered = _values_and_grads(lambda h, w, b, t: naive(h, w, b, t, 1.0), *inputs, False)
    for value, wrong in zip(got[2:], untempered[2:]):
        with pytest.raises(AssertionError):
            assert_float32_close(value, wrong)
        with pytest.raises(AssertionError):
            assert_float32_close(value * (1 + 1e-4), value)


@pytest.mark.timeout(60)
def test_no_grad_and_frozen_head():
    hidden_NH, weight_VH, _, targets_N, weights_N, _ = _inputs(10, 8, 41, torch.float32, bias=False)
    with torch.no_grad():
        logprobs_N, _ = head_logprobs_and_entropy(hidden_NH, weight_VH, None, targets_N, 0.9, 3)
    assert not logprobs_N.requires_grad
    torch.testing.assert_close(logprobs_N, naive(hidden_NH, weight_VH, None, targets_N, 0.9)[0].detach(), **FLOAT32)
    # A frozen head (LoRA without adapters on it): the hidden states still get their gradient, the head none.
    frozen_VH = weight_VH.detach()
    (weights_N * head_logprobs_and_entropy(hidden_NH, frozen_VH, None, targets_N, 0.9, 3)[0]).sum().backward()
    fused_grad = hidden_NH.grad.clone()
    hidden_NH.grad = None
    (weights_N * naive(hidden_NH, frozen_VH, None, targets_N, 0.9)[0]).sum().backward()
    assert_float32_close(fused_grad, hidden_NH.grad)
    empty_lp, empty_ent = head_logprobs_and_entropy(hidden_NH[:0], weight_VH, None, targets_N[:0])
    assert empty_lp.shape == empty_ent.shape == (0,)


# ------------------------------------------------------------------ through a model


class _LargestVocabTensor(TorchDispatchMode):
    """Records the most elements any tensor of per-token vocabulary rows (`[..., V]`, not the head's
    weight or its transpose `[H, V]`) had, among every op's outputs, forward and backward."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                if tuple(t.shape) != (self.hidden, self.vocab):
                    self.largest = max(self.largest, t.numel())
        return out


def _tiny(tied=True, seed=0, dtype="float32"):
    tokenizer = build_char_tokenizer("printable")
    model = build_tiny_model(ModelConfig(dtype=dtype), len(tokenizer), seed=seed, tokenizer=tokenizer)
    if not tied:  # an untied head of its own, with a bias (Qwen2's has none)
        model.config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    return model.eval()


def _batch(vocab, B=3, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(3, vocab, (B, T), generator=g)
    attention_BT = torch.ones(B, T, dtype=torch.long)
    attention_BT[1, 8:] = 0  # right padding, as the trainer's batches
    weights_BT = torch.randn(B, T - 1, generator=g)
    return tokens_BT, attention_BT, weights_BT


def _step(model, tokens_BT, attention_BT, weights_BT, fused, temperature=0.7, first_scored=0, entropy_grad=False):
    """Logprobs, entropy and every trainable parameter's gradient of one loss through `token_logprobs`."""
    model.zero_grad(set_to_none=True)
    logprobs_BT, entropy_BT = token_logprobs(
        model, tokens_BT, attention_BT, temperature, first_scored, entropy_grad=entropy_grad, fused_head=fused
    )
    loss = (weights_BT * logprobs_BT).sum() + (0.3 * entropy_BT.sum() if entropy_grad else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs_BT.detach(), entropy_BT.detach(), grads


def _assert_same(fused, unfused):
    assert_float32_close(fused[0], unfused[0], "logprobs")
    assert_float32_close(fused[1], unfused[1], "entropy")
    assert fused[2].keys() == unfused[2].keys() and fused[2]
    for name in unfused[2]:
        assert_float32_close(fused[2][name], unfused[2][name], name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("first_scored,entropy_grad", [(0, False), (0, True), (5, False)])
def test_a_model_trains_the_same_with_the_fused_head(tied, first_scored, entropy_grad):
    model = _tiny(tied)
    assert split_lm_head(model)[0] is not None
    if tied:  # the head's weight is the embedding: one parameter, both gradients in it
        assert model.lm_head.weight is model.get_input_embeddings().weight
    batch = _batch(model.config.vocab_size)
    fused = _step(model, *batch, fused=True, first_scored=first_scored, entropy_grad=entropy_grad)
    unfused = _step(model, *batch, fused=False, first_scored=first_scored, entropy_grad=entropy_grad)
    _assert_same(fused, unfused)
    if first_scored:
        assert fused[0][:, :first_scored].abs().max() == 0 and fused[0][:, first_scored:].abs().min() > 0


@pytest.mark.timeout(120)
def test_bfloat16_model_is_close_to_its_unfused_path():
    model = _tiny(dtype="bfloat16")
    batch = _batch(model.config.vocab_size)
    fused, unfused = (_step(model, *batch, fused=f) for f in (True, False))
    torch.testing.assert_close(fused[0], unfused[0], atol=1e-4, rtol=1e-4)
    for name, want in unfused[2].items():
        scale = want.float().abs().max()
        torch.testing.assert_close(fused[2][name].float(), want.float(), atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.timeout(120)
def test_mixed_precision_computes_the_head_in_autocast_dtype_both_ways():
    # trainer.precision=bf16-mixed: float32 weights, the head's matmul in bf16 under autocast, in the
    # forward and again in the backward's recomputation (which runs outside autocast).
    model = _tiny()
    batch = _batch(model.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, unfused = (_step(model, *batch, fused=f) for f in (True, False))
    plain = _step(model, *batch, fused=True)
    torch.testing.assert_close(fused[0], unfused[0], atol=1e-4, rtol=1e-4)
    assert (fused[0] - plain[0]).abs().max() > 1e-4  # bf16 logits indeed, not float32 ones
    for name, want in unfused[2].items():
        scale = want.abs().max()
        torch.testing.assert_close(fused[2][name], want, atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.timeout(120)
def test_no_vocabulary_sized_tensor_beyond_a_chunk():
    # The fused head's largest [*, V] tensor is a chunk of rows; the unfused path's is the logits of every row.
    model = _tiny(tied=False)
    V = model.config.vocab_size
    tokens_BT, attention_BT, weights_BT = _batch(V, B=4, T=40)
    largest = {}
    for fused in (True, False):
        with _LargestVocabTensor(V, model.config.hidden_size) as meter:
            _step(model, tokens_BT, attention_BT, weights_BT, fused=fused, entropy_grad=True)
        largest[fused] = meter.largest
    chunk_rows = default_chunk_rows(V, FUSED_CHUNK_BYTES)  # the default chunk: all 156 rows here
    chunk_rows = min(chunk_rows, 4 * 39)
    assert largest[False] >= 4 * 40 * V  # the unfused path does make the full logits (the meter sees them)
    with _LargestVocabTensor(V, model.config.hidden_size) as meter:
        with torch.no_grad():
            token_logprobs(model, tokens_BT, attention_BT, 1.0, fused_head=True)
    assert meter.largest <= chunk_rows * V
    # With a small chunk the bound is the chunk's, not the batch's.
    split, _ = split_lm_head(model)
    with _LargestVocabTensor(V, model.config.hidden_size) as meter:
        logprobs_BT, _ = fused_token_logprobs(split, tokens_BT, attention_BT, 1.0, entropy_grad=True, chunk_rows=8)
        (weights_BT * logprobs_BT).sum().backward()
    assert 0 < meter.largest <= 8 * V


@pytest.mark.timeout(120)
def test_lora_policy_and_its_adapter_free_reference_are_fused_exactly():
    model = _tiny()
    reference_model = copy.deepcopy(model)
    policy = lora_policy_that_moves(model)
    batch = _batch(model.config.vocab_size)
    assert split_lm_head(policy)[0] is not None
    _assert_same(*(_step(policy, *batch, fused=f) for f in (True, False)))

    view = AdapterFreeView(policy)
    with torch.no_grad():
        fused_ref = token_logprobs(view, batch[0], batch[1], 0.7, fused_head=True)[0]
        unfused_ref = token_logprobs(view, batch[0], batch[1], 0.7, fused_head=False)[0]
        base_ref = token_logprobs(reference_model, batch[0], batch[1], 0.7, fused_head=False)[0]
        policy_lp = token_logprobs(policy, batch[0], batch[1], 0.7, fused_head=True)[0]
    torch.testing.assert_close(fused_ref, unfused_ref, **FLOAT32)
    torch.testing.assert_close(fused_ref, base_ref, **FLOAT32)  # the adapters are off in the view
    assert (policy_lp - fused_ref).abs().max() > 1e-3  # and on in the policy


@pytest.mark.timeout(120)
def test_a_lora_wrapped_head_falls_back_to_the_full_logits(caplog):
    model = _tiny(tied=False)
    policy = apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]), seed=0)
    split, why_not = split_lm_head(policy)
    assert split is None and "not a plain nn.Linear" in why_not
    batch = _batch(model.config.vocab_size)
    with caplog.at_level("DEBUG", logger="lit_grpo.maths.logprobs"):
        fused = _step(policy, *batch, fused=True)
    assert any("fused LM head off" in r.message for r in caplog.records)
    unfused = _step(policy, *batch, fused=False)
    for a, b in zip(fused[:2], unfused[:2]):
        assert torch.equal(a, b)  # the very same path


@pytest.mark.timeout(60)
def test_a_transform_after_the_head_is_not_fused():
    model = _tiny()
    model.config.final_logit_softcapping = 30.0
    split, why_not = split_lm_head(model)
    assert split is None and "final_logit_softcapping" in why_not


# ------------------------------------------------------------------ training, on and off


def _losses(tmp_path, monkeypatch, loss_name, fused):
    """The train/loss of 3 steps, and how many forwards went through the fused head (padded or packed)."""
    import lit_grpo.maths.head_logprobs as head_logprobs_py
    import lit_grpo.maths.logprobs as logprobs_py

    fused_calls = []

    def counted(*args, **kwargs):
        fused_calls.append(torch.is_grad_enabled())
        return head_logprobs_and_entropy(*args, **kwargs)

    for module in (head_logprobs_py, logprobs_py):  # the padded path calls it from the one, the packed from the other
        monkeypatch.setattr(module, "head_logprobs_and_entropy", counted)
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            f"policy_loss={loss_name}",
            "policy_loss.kl_beta=0.05",  # a reference forward too
            "ppo_n_minibatches=2",  # and an old-policy forward
            "entropy.coef=0.01",  # and the entropy's gradient
            "max_steps=3",
            "trainer.enable_progress_bar=false",
            "logger=none",
            f"model.fused_lm_head={str(fused).lower()}",
            output_dir=tmp_path / f"{loss_name}-{fused}",
        )
    )
    trainer, module, datamodule = build_run(c)
    trainer.fit(module, datamodule=datamodule)
    return [step["train/loss"] for step in module.step_sequence.history.steps], fused_calls


@pytest.mark.slow  # 20 short runs: about 5 minutes on two cores
@pytest.mark.timeout(1200)
def test_every_policy_loss_trains_the_same_with_the_fused_head_on_and_off(tmp_path, monkeypatch):
    from lit_grpo.maths.losses import POLICY_LOSSES

    # The built-in losses (each has a config file); another test's registered loss has none.
    # (`user.yaml` names no loss of its own: the user's `policy_loss.name`.)
    configs = {p.stem for p in (Path(lit_grpo.__file__).parent / "conf" / "policy_loss").glob("*.yaml")}
    builtin = sorted(configs & set(POLICY_LOSSES))
    assert len(builtin) >= 7
    for name in builtin:
        (on, calls_on), (off, calls_off) = (_losses(tmp_path, monkeypatch, name, fused) for fused in (True, False))
        assert len(on) == len(off) == 3, name
        # On: the policy's forwards (with gradients) and the reference's and old policy's (without) are fused.
        assert set(calls_on) == {True, False} and calls_off == [], name
        for a, b in zip(on, off):
            assert abs(a - b) <= 1e-5 * max(abs(b), 1e-6), (name, on, off)
