"""Padding-free micro-batches: the packed layout worked out by hand, and packed forwards that give the
padded ones' logprobs, entropy and gradients (the attention never crosses a sequence boundary)."""

import copy

import pytest
import torch
from conftest import assert_same_forward, lora_policy_that_moves

from lit_grpo.config import ModelConfig
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.maths.packing import (
    SEGMENTED_SDPA,
    PackedBlock,
    pack_rows,
    packed_forward,
    packing_support,
    unpack_predictions,
    use_segmented_sdpa,
)
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model
from lit_grpo.models.lora import AdapterFreeView

# Three right-padded rows of 3, 2 and 4 real tokens.
TOKENS = torch.tensor([[11, 12, 13, 0], [14, 15, 0, 0], [16, 17, 18, 19]])
ATTENTION = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


@pytest.mark.timeout(30)
def test_the_packed_layout_by_hand():
    packed = pack_rows(TOKENS, ATTENTION)
    assert packed.tokens_1N.tolist() == [[11, 12, 13, 14, 15, 16, 17, 18, 19]]
    assert packed.positions_1N.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # Each sequence's last token predicts nothing: 2 + 1 + 3 predictions, none across a boundary.
    assert packed.predicting_M.tolist() == [0, 1, 3, 5, 6, 7]
    assert packed.targets_M.tolist() == [12, 13, 15, 17, 18, 19]
    assert packed.rows_M.tolist() == [0, 0, 1, 2, 2, 2]
    assert packed.columns_M.tolist() == [0, 1, 0, 0, 1, 2]
    assert packed.shape == (3, 3)
    assert packed.blocks == (PackedBlock(0, 3), PackedBlock(3, 2), PackedBlock(5, 4))

    later = pack_rows(TOKENS, ATTENTION, first_scored=1)  # predictions from column 1 on
    assert later.predicting_M.tolist() == [1, 6, 7] and later.targets_M.tolist() == [13, 18, 19]


@pytest.mark.timeout(30)
def test_unpacking_puts_each_value_at_its_padded_place_and_keeps_the_gradient():
    packed = pack_rows(TOKENS, ATTENTION)
    values_M = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    out_BT = unpack_predictions(packed, values_M)
    assert out_BT.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 5.0, 6.0]]
    (out_BT * torch.arange(9.0).view(3, 3)).sum().backward()
    assert values_M.grad.tolist() == [0.0, 1.0, 3.0, 6.0, 7.0, 8.0]


def _tiny(attention="sdpa", tied=True):
    tokenizer = build_char_tokenizer("printable")
    model = build_tiny_model(ModelConfig(), len(tokenizer), seed=0, tokenizer=tokenizer)
    model.config._attn_implementation = attention
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    return model.eval()


def _ragged(vocab, B=4, T=13, seed=1):
    """Right-padded rows of ragged lengths (one of them full), and loss weights on the predictions."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(3, vocab, (B, T), generator=g)
    lengths = [T, 5, 9, 2][:B]
    attention_BT = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    tokens_BT = tokens_BT * attention_BT  # pad id 0 in the padding, as a collated batch
    weights_BT = torch.randn(B, T - 1, generator=g) * attention_BT[:, 1:]
    return tokens_BT, attention_BT, weights_BT


def _step(model, tokens_BT, attention_BT, weights_BT, padding_free, fused=True, first_scored=0, entropy_grad=True):
    model.zero_grad(set_to_none=True)
    logprobs_BT, entropy_BT = token_logprobs(
        model, tokens_BT, attention_BT, 0.7, first_scored, entropy_grad=entropy_grad,
        fused_head=fused, padding_free=padding_free,
    )  # fmt: skip
    real_BT = (attention_BT[:, :-1] * attention_BT[:, 1:]).bool()
    loss = (weights_BT * logprobs_BT).sum() + 0.3 * (entropy_BT * real_BT).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs_BT.detach() * real_BT, entropy_BT.detach() * real_BT, grads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("fused,tied", [(True, True), (True, False), (False, True)])
def test_packed_forwards_equal_the_padded_ones(attention, fused, tied):
    model = _tiny(attention, tied)
    assert packing_support(model) == ""
    batch = _ragged(model.config.vocab_size)
    packed = _step(model, *batch, padding_free=True, fused=fused)
    padded = _step(model, *batch, padding_free=False, fused=fused)
    assert_same_forward(packed, padded)
    # Outside the real predictions the packed path computes nothing.
    raw = token_logprobs(model, batch[0], batch[1], 0.7, fused_head=fused, padding_free=True)[0]
    assert raw[1, 4:].abs().max() == 0 and raw[3, 1:].abs().max() == 0


@pytest.mark.timeout(120)
def test_attention_that_crossed_a_boundary_would_be_caught():
    # The same rows with each sequence's position ids running on from the previous one's (one long
    # sequence to transformers) give other logprobs: the equality above is not a coincidence.
    model = _tiny()
    tokens_BT, attention_BT, _ = _ragged(model.config.vocab_size)
    packed = pack_rows(tokens_BT, attention_BT)
    with torch.no_grad():
        # No cache: with one, transformers does not read packed sequences from the position ids.
        apart = model(input_ids=packed.tokens_1N, position_ids=packed.positions_1N, use_cache=False).logits
        running = torch.arange(packed.tokens_1N.shape[1])[None, :]
        joined = model(input_ids=packed.tokens_1N, position_ids=running, use_cache=False).logits
    first = int(attention_BT[0].sum())  # the first sequence is the same either way
    torch.testing.assert_close(apart[:, :first], joined[:, :first])
    assert (apart[:, first:] - joined[:, first:]).abs().max() > 1e-3


@pytest.mark.timeout(120)
def test_first_scored_skips_the_prompt_in_the_packed_path_too():
    model = _tiny()
    batch = _ragged(model.config.vocab_size)
    packed = _step(model, *batch, padding_free=True, first_scored=3)
    padded = _step(model, *batch, padding_free=False, first_scored=3)
    assert_same_forward(packed, padded)
    assert packed[0][:, :3].abs().max() == 0 and packed[0][0, 3:].abs().min() > 0


@pytest.mark.timeout(120)
def test_lora_policy_and_its_adapter_free_view_pack_exactly():
    model = _tiny()
    reference = copy.deepcopy(model)
    policy = lora_policy_that_moves(model)
    batch = _ragged(model.config.vocab_size)
    assert packing_support(policy) == ""
    assert_same_forward(*(_step(policy, *batch, padding_free=p) for p in (True, False)))
    view = AdapterFreeView(policy)
    real_BT = (batch[1][:, :-1] * batch[1][:, 1:]).bool()
    with torch.no_grad():
        view_packed = token_logprobs(view, batch[0], batch[1], 0.7, padding_free=True)[0] * real_BT
        base_padded = token_logprobs(reference, batch[0], batch[1], 0.7, padding_free=False)[0] * real_BT
    torch.testing.assert_close(view_packed, base_padded, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(60)
def test_models_that_cannot_pack_say_why_and_take_the_padded_path(caplog):
    assert "not a transformers model" in packing_support(torch.nn.Linear(2, 2))
    model = _tiny()
    model.config._attn_implementation = "paged_attention"
    assert "'paged_attention' is not one of" in packing_support(model)
    multimodal = _tiny()
    multimodal.config.vision_config = {"hidden_size": 8}
    assert "multimodal" in packing_support(multimodal)

    batch = _ragged(model.config.vocab_size)
    model.config._attn_implementation = "sdpa"  # runs, but the cached answer stays: padded, said once
    with caplog.at_level("DEBUG", logger="lit_grpo.maths.logprobs"):
        with torch.no_grad():
            got = token_logprobs(model, batch[0], batch[1], 0.7, padding_free=True)[0]
            want = token_logprobs(model, batch[0], batch[1], 0.7, padding_free=False)[0]
    assert torch.equal(got, want)  # the very same padded path
    assert sum("padding-free micro-batches off" in r.message for r in caplog.records) == 1


class _SdpaCalls:
    """Records the key length and mask of every `scaled_dot_product_attention` call (transformers' sdpa calls it)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, bool, bool]] = []
        original = torch.nn.functional.scaled_dot_product_attention

        def recording(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
            self.calls.append((key.shape[-2], attn_mask is not None, is_causal))
            return original(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)


@pytest.mark.timeout(120)
def test_packed_sdpa_attends_within_each_sequence_without_a_mask(monkeypatch):
    # An sdpa model runs a packed forward one sequence at a time (causal, no [N, N] mask), with
    # the values of transformers' block-diagonal mask over the whole row and of the padded forward.
    model = _tiny("sdpa")
    tokens_BT, attention_BT, _ = _ragged(model.config.vocab_size)
    packed = pack_rows(tokens_BT, attention_BT)
    calls = _SdpaCalls(monkeypatch)
    with torch.no_grad():
        got_BT = token_logprobs(model, tokens_BT, attention_BT, 1.0, padding_free=True)[0]
    assert model.config._attn_implementation == SEGMENTED_SDPA
    layers = model.config.num_hidden_layers
    assert calls.calls == [(n, False, n > 1) for n in (13, 5, 9, 2)] * layers

    calls.calls.clear()
    with torch.no_grad():  # outside a packed forward: transformers' sdpa and its block-diagonal mask
        logits_1NV = model(input_ids=packed.tokens_1N, position_ids=packed.positions_1N, use_cache=False).logits
    assert calls.calls == [(29, True, False)] * layers
    want_M = torch.log_softmax(logits_1NV[0, packed.predicting_M], -1).gather(-1, packed.targets_M[:, None])[:, 0]
    torch.testing.assert_close(got_BT, unpack_predictions(packed, want_M), atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_the_segmented_model_generates_as_sdpa_does():
    # Outside packed forwards the switched model is transformers' sdpa: the same greedy tokens and scores.
    model = _tiny("sdpa")
    before = copy.deepcopy(model)
    assert use_segmented_sdpa(model) and model.config._attn_implementation == SEGMENTED_SDPA
    assert before.config._attn_implementation == "sdpa"
    prompts = torch.tensor([[0, 0, 21, 22, 23], [31, 32, 33, 34, 35]])
    attention = (prompts != 0).long()
    outputs = [
        m.generate(
            input_ids=prompts, attention_mask=attention, max_new_tokens=6, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )
        for m in (model, before)
    ]  # fmt: skip
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    torch.testing.assert_close(torch.stack(outputs[0].scores), torch.stack(outputs[1].scores))


@pytest.mark.timeout(120)
def test_a_sliding_window_model_keeps_sdpa_and_its_mask():
    model = _tiny("sdpa")
    model.config.sliding_window = 64
    assert not use_segmented_sdpa(model) and model.config._attn_implementation == "sdpa"
    batch = _ragged(model.config.vocab_size)
    assert_same_forward(_step(model, *batch, padding_free=True), _step(model, *batch, padding_free=False))


@pytest.mark.timeout(60)
def test_a_packed_forward_whose_bounds_do_not_reach_the_attention_stops():
    # Without its mask and without the bounds, attention would run across the whole packed row.
    model = _tiny("sdpa")
    tokens_BT, attention_BT, _ = _ragged(model.config.vocab_size)
    packed = pack_rows(tokens_BT, attention_BT)
    with torch.no_grad(), packed_forward(model, packed) as attention_kwargs:
        assert attention_kwargs == {"packed_blocks": tuple((block, None) for block in packed.blocks)}
        with pytest.raises(RuntimeError, match="batching.padding_free=false"):
            model(input_ids=packed.tokens_1N, position_ids=packed.positions_1N, use_cache=False)


@pytest.mark.timeout(30)
def test_a_position_bias_over_the_packed_row_is_refused():
    from lit_grpo.maths.packing import _segmented_sdpa_attention

    model = _tiny("sdpa")
    attention = model.model.layers[0].self_attn
    query = key = value = torch.zeros(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="batching.padding_free=false"):
        _segmented_sdpa_attention(
            attention, query, key, value, None, ((PackedBlock(0, 2), None), (PackedBlock(2, 3), None)),
            position_bias=torch.zeros(1, 2, 5, 5),
        )  # fmt: skip
