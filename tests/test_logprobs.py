"""Chunked selected-token logprobs and entropy: the same values and gradients as the naive formula."""

import math

import pytest
import torch

from lit_grpo.loop.module import token_logprobs
from lit_grpo.maths.logprobs import default_chunk_rows, first_scored_prediction, selected_logprobs_and_entropy

FLOAT32 = {"atol": 1e-6, "rtol": 1e-6}


def naive(logits_BTV, targets_BT, temperature):
    """The formula `token_logprobs` used before chunking: [B, T, V] -> ([B, T], [B, T])."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logprobs_BT = logp_BTV.gather(-1, targets_BT[..., None])[..., 0]
    with torch.no_grad():
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return logprobs_BT, entropy_BT


def _leaf_logits(B, T, V, dtype=torch.float32, seed=0):
    """Spread-out logits (some near-one-hot rows), one extra position so `[:, :-1]` is a strided view."""
    g = torch.Generator().manual_seed(seed)
    full_BTV = (torch.randn(B, T + 1, V, generator=g) * 4).to(dtype)
    return full_BTV.requires_grad_(True)


def _values_and_grad(fn, full_BTV, targets_BT, weights_BT, temperature):
    """Logprobs, entropy and d(sum(weights * logprobs))/d logits (of the strided `[:, :-1]` view)."""
    full_BTV.grad = None
    logprobs_BT, entropy_BT = fn(full_BTV[:, :-1], targets_BT, temperature)
    (weights_BT * logprobs_BT).sum().backward()
    return logprobs_BT.detach(), entropy_BT, full_BTV.grad.clone()


def chunked(chunk_rows):
    """`selected_logprobs_and_entropy` with a fixed chunk size, called like `naive`."""
    return lambda logits_BTV, targets_BT, temperature: selected_logprobs_and_entropy(
        logits_BTV, targets_BT, temperature, chunk_rows
    )


def _targets_and_weights(B, T, V, seed=1):
    g = torch.Generator().manual_seed(seed)
    # Signed weights, some zero (as masked padding positions are): any target id is in range.
    weights_BT = torch.randn(B, T, generator=g) * (torch.rand(B, T, generator=g) > 0.2)
    return torch.randint(0, V, (B, T), generator=g), weights_BT


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 15, 64, None])  # B*T = 15: divides, does not, one chunk, more than all
def test_float32_values_and_gradients_match_the_naive_formula(temperature, chunk_rows):
    B, T, V = 3, 5, 97
    full_BTV = _leaf_logits(B, T, V)
    targets_BT, weights_BT = _targets_and_weights(B, T, V)

    got = _values_and_grad(chunked(chunk_rows), full_BTV, targets_BT, weights_BT, temperature)
    expected = _values_and_grad(naive, full_BTV, targets_BT, weights_BT, temperature)

    for value, want in zip(got, expected):
        torch.testing.assert_close(value, want, **FLOAT32)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert not got[1].requires_grad
    assert full_BTV.grad[:, -1].abs().max() == 0  # the position outside the view gets no gradient


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bfloat16_logits_match_the_float32_cast_path(temperature):
    B, T, V = 2, 9, 131
    full_BTV = _leaf_logits(B, T, V, dtype=torch.bfloat16, seed=3)
    targets_BT, weights_BT = _targets_and_weights(B, T, V, seed=4)

    logprobs_BT, entropy_BT, grad_BTV = _values_and_grad(chunked(5), full_BTV, targets_BT, weights_BT, temperature)
    expected = _values_and_grad(naive, full_BTV, targets_BT, weights_BT, temperature)

    assert grad_BTV.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs_BT, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy_BT, expected[1], atol=1e-5, rtol=1e-5)
    # Both gradients are float32 values rounded once to bf16: at most one bf16 step apart.
    torch.testing.assert_close(grad_BTV.float(), expected[2].float(), atol=1e-6, rtol=2**-7)


@pytest.mark.timeout(60)
def test_a_wrong_gradient_would_be_caught():
    # Guard on the tolerances above: the gradient without the 1/temperature factor must fail them.
    B, T, V, temperature = 2, 4, 53, 0.6
    full_BTV = _leaf_logits(B, T, V)
    targets_BT, weights_BT = _targets_and_weights(B, T, V)
    _, _, grad_BTV = _values_and_grad(chunked(3), full_BTV, targets_BT, weights_BT, temperature)
    _, _, untempered_BTV = _values_and_grad(naive, full_BTV, targets_BT, weights_BT, 1.0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grad_BTV, untempered_BTV, **FLOAT32)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grad_BTV, grad_BTV * (1 + 1e-4), **FLOAT32)


@pytest.mark.timeout(60)
def test_known_values_for_a_uniform_and_a_peaked_row():
    V = 8
    logits_BTV = torch.stack([torch.zeros(V), torch.tensor([10.0] + [0.0] * (V - 1))])[None]
    logprobs_BT, entropy_BT = selected_logprobs_and_entropy(logits_BTV, torch.tensor([[3, 0]]), 1.0, chunk_rows=1)
    torch.testing.assert_close(logprobs_BT[0, 0], torch.tensor(-math.log(V)))
    torch.testing.assert_close(entropy_BT[0, 0], torch.tensor(math.log(V)))
    peaked_logp = torch.log_softmax(logits_BTV[0, 1], -1)
    torch.testing.assert_close(logprobs_BT[0, 1], peaked_logp[0])
    assert 0 < entropy_BT[0, 1] < 0.01


@pytest.mark.timeout(60)
def test_no_grad_and_empty_inputs():
    full_BTV = _leaf_logits(2, 4, 11)
    targets_BT, _ = _targets_and_weights(2, 4, 11)
    with torch.no_grad():
        logprobs_BT, entropy_BT = selected_logprobs_and_entropy(full_BTV[:, :-1], targets_BT, 0.9, chunk_rows=3)
    expected = naive(full_BTV[:, :-1].detach(), targets_BT, 0.9)
    torch.testing.assert_close(logprobs_BT, expected[0], **FLOAT32)
    assert not logprobs_BT.requires_grad
    empty_lp, empty_ent = selected_logprobs_and_entropy(torch.zeros(2, 0, 11), torch.zeros(2, 0, dtype=torch.long))
    assert empty_lp.shape == empty_ent.shape == (2, 0)


@pytest.mark.timeout(60)
def test_default_chunk_is_about_32_mib_of_float32():
    assert default_chunk_rows(151_936) == 55
    assert default_chunk_rows(10**9) == 1
    with pytest.raises(ValueError):
        selected_logprobs_and_entropy(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), chunk_rows=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_logprobs_of_a_tiny_model_match_the_old_formula(tiny_model, tokenizer, temperature):
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("12+3=15", "7+8=15", "1+1=2")]
    width = max(map(len, rows))
    tokens_BT = torch.tensor([r + [tokenizer.pad_token_id or 0] * (width - len(r)) for r in rows])
    attention_BT = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    weights_BT = attention_BT[:, 1:].float() * torch.linspace(-1, 1, width - 1)

    def run(fn):
        tiny_model.zero_grad()
        logprobs_BT, entropy_BT = fn()
        (weights_BT * logprobs_BT).sum().backward()
        return logprobs_BT.detach(), entropy_BT, [p.grad.clone() for p in tiny_model.parameters()]

    def old():
        logits_BTV = tiny_model(input_ids=tokens_BT, attention_mask=attention_BT, use_cache=False).logits[:, :-1]
        return naive(logits_BTV, tokens_BT[:, 1:], temperature)

    new_lp, new_ent, new_grads = run(lambda: token_logprobs(tiny_model, tokens_BT, attention_BT, temperature))
    old_lp, old_ent, old_grads = run(old)
    assert new_lp.shape == new_ent.shape == (3, width - 1)
    torch.testing.assert_close(new_lp, old_lp, **FLOAT32)
    torch.testing.assert_close(new_ent, old_ent, **FLOAT32)
    for new, old_grad in zip(new_grads, old_grads):
        torch.testing.assert_close(new, old_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.timeout(60)
def test_skipping_the_prompt_keeps_every_scored_value_and_gradient(tiny_model):
    """`first_scored` runs the LM head from that column only: the logprobs and entropy from there on,
    and the gradient of a loss on them, are those of the full computation; the columns before are 0."""
    g = torch.Generator().manual_seed(3)
    tokens_BT = torch.randint(3, 90, (3, 14), generator=g)
    attention_BT = torch.ones_like(tokens_BT)
    attention_BT[2, 11:] = 0  # a right-padded row
    weights_BT = torch.randn(3, 13, generator=g)
    first = 6

    def run(first_scored):
        tiny_model.zero_grad()
        logprobs_BT, entropy_BT = token_logprobs(tiny_model, tokens_BT, attention_BT, 0.7, first_scored)
        (weights_BT[:, first:] * logprobs_BT[:, first:]).sum().backward()
        return logprobs_BT.detach(), entropy_BT, {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    full_lp, full_ent, full_grads = run(0)
    cut_lp, cut_ent, cut_grads = run(first)
    assert cut_lp.shape == full_lp.shape == (3, 13)
    assert torch.equal(cut_lp[:, :first], torch.zeros(3, first)) and torch.equal(
        cut_ent[:, :first], torch.zeros(3, first)
    )
    torch.testing.assert_close(cut_lp[:, first:], full_lp[:, first:], **FLOAT32)
    torch.testing.assert_close(cut_ent[:, first:], full_ent[:, first:], **FLOAT32)
    for name, grad in full_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert first_scored_prediction(torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])) == 2
    assert first_scored_prediction(torch.zeros(2, 4)) == 0  # nothing trained: nothing skipped
