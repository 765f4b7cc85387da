"""Rows that begin alike computed once (`lit_grpo.maths.shared_prefix`): which rows share and how
much, the packed layout worked out by hand, and forwards whose logprobs, entropy and every
parameter's gradient equal those of each row computed whole."""

import logging

import pytest
import torch
from conftest import assert_same_forward, lora_policy_that_moves

from lit_grpo.config import ModelConfig
from lit_grpo.loop.micro_batches import plan_forwards
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.maths.packing import PackedBlock, PackingCost, block_mask, pack_rows, packing_cost
from lit_grpo.maths.shared_prefix import AttentionCosts, PrefixGroup, common_prefix, shared_prefix_groups
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model

# Rows 0 and 2 begin with [11, 12, 13]; row 1 is another prompt.
TOKENS = torch.tensor([[11, 12, 13, 14, 0], [21, 22, 0, 0, 0], [11, 12, 13, 15, 16]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
# Tokens are what count: a call costs nothing and pairs next to nothing, so any shared token pays.
CHEAP_CALLS = AttentionCosts(per_token=1.0, per_pair=1e-6, per_call=0.0)


@pytest.mark.timeout(30)
def test_the_shared_layout_by_hand():
    packed = pack_rows(TOKENS, ATTENTION, groups=[PrefixGroup((0, 2), 3, dense=False)])
    # The group's block first (its first row comes first): the prefix once, row 0's suffix, row 2's.
    assert packed.tokens_1N.tolist() == [[11, 12, 13, 14, 15, 16, 21, 22]]
    assert packed.positions_1N.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]
    assert packed.blocks == (PackedBlock(0, 3, (1, 2), dense=False), PackedBlock(6, 2))
    # Row 0 predicts from columns 0..2 (prefix rows 0, 1, 2); row 1 from packed 6; row 2 from prefix
    # rows 0..2 then its suffix's first token (packed 4). The prefix's last row predicts 14 and 15.
    assert packed.predicting_M.tolist() == [0, 1, 2, 6, 0, 1, 2, 4]
    assert packed.targets_M.tolist() == [12, 13, 14, 22, 12, 13, 15, 16]
    assert packed.rows_M.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert packed.columns_M.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert packed.shape == (3, 4) and packed.shares_prefixes


@pytest.mark.timeout(30)
def test_the_group_mask_by_hand():
    # Prefix of 2, suffixes of 2 and 1: each suffix sees the prefix and its own earlier tokens.
    _, dense = block_mask(PackedBlock(0, 2, (2, 1), dense=True), torch.device("cpu"))
    assert dense.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    # A group attended a suffix at a time, and a sequence alone, are causal: no mask.
    assert block_mask(PackedBlock(0, 2, (2, 1), dense=False), torch.device("cpu"))[1] is None
    assert block_mask(PackedBlock(0, 5), torch.device("cpu"))[1] is None


@pytest.mark.timeout(30)
def test_which_rows_share_and_how_much():
    system = [1, 2, 3]
    a = system + [10, 11, 12, 13]  # prompt a: 7 tokens
    b = system + [20, 21, 22, 23]  # prompt b: shares only the 3 system tokens with a
    rows = [a + [5], b + [6], a + [7, 8], [9, 9], b + [6, 1], a + [5, 2]]
    groups = shared_prefix_groups(rows, CHEAP_CALLS)
    # Each prompt's samples together, over their own prompt (and the first completion token that
    # rows 0 and 5 have in common does not split the group: 3 rows × 7 save more than 2 × 8).
    assert [(g.rows, g.prefix) for g in groups] == [((0, 2, 5), 7), ((1, 4), 8)]
    assert sum(g.saved_tokens() for g in groups) == 2 * 7 + 1 * 8
    # Rows that have nothing in common, or a lone row, share nothing.
    assert shared_prefix_groups([[1, 2], [3, 4], [5]], CHEAP_CALLS) == ()
    # Where only the system prompt is common, the rows share it.
    assert [(g.rows, g.prefix) for g in shared_prefix_groups([a, b], CHEAP_CALLS)] == [((0, 1), 3)]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1], [1]) == 1


@pytest.mark.timeout(30)
def test_sharing_is_chosen_by_its_cost():
    # Pairs alone cost, and calls: one shared token is not worth a masked square (21² pairs against
    # two causal rows' 2 × 66), and a call per suffix computes the rows' own pairs: left whole.
    pairs = AttentionCosts(per_token=0.0, per_pair=1.0, per_call=1.0)
    assert pairs.unshared(1, [10, 10]) == pairs.split(1, [10, 10]) == 134 and pairs.dense(1, [10, 10]) == 442
    assert shared_prefix_groups([[1] + [7] * 10, [1] + [8] * 10], pairs) == ()
    rows = [[1, 2, 3, 4], [1, 2, 3, 5]]
    # A short group in one masked call: 3 + 2 rows, 25 pairs, 1 call = 5 + 25·0.01 + 1 = 6.25 against
    # a call per suffix's 5 + 2·10·0.01 + 2 = 7.2 and whole rows' 8 + 20·0.01 + 2 = 10.2.
    costs = AttentionCosts(per_token=1.0, per_pair=0.01, per_call=1.0)
    assert costs.dense(3, [1, 1]) == pytest.approx(6.25) and costs.split(3, [1, 1]) == pytest.approx(7.2)
    assert costs.unshared(3, [1, 1]) == pytest.approx(10.2)
    assert shared_prefix_groups(rows, costs) == (PrefixGroup((0, 1), 3, dense=True),)
    # Long suffixes: the square's pairs cost more than a call per suffix.
    long_rows = [[1, 2, 3] + [7] * 100, [1, 2, 3] + [8] * 100]
    assert shared_prefix_groups(long_rows, costs) == (PrefixGroup((0, 1), 3, dense=False),)


def _tiny():
    tokenizer = build_char_tokenizer("printable")
    model = build_tiny_model(ModelConfig(), len(tokenizer), seed=0, tokenizer=tokenizer)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _grouped_batch(vocab, G, prompt_len=9, seed=0):
    """Two prompts' groups of G ragged completions (one completion empty) and a lone row, right-padded,
    interleaved as a token-budget plan may order them; loss weights on the completions' predictions."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(2)]
    rows = []
    for k in range(G):
        for prompt in prompts:
            n = int(torch.randint(0, 7, (), generator=g)) if k else 0
            rows.append((prompt + torch.randint(3, vocab, (n,), generator=g).tolist(), prompt_len))
    rows.append((torch.randint(3, vocab, (5,), generator=g).tolist(), 2))
    T = max(len(r) for r, _ in rows)
    tokens_BT = torch.zeros(len(rows), T, dtype=torch.long)
    attention_BT = torch.zeros_like(tokens_BT)
    weights_BT = torch.zeros(len(rows), T - 1)
    for i, (r, first) in enumerate(rows):
        tokens_BT[i, : len(r)] = torch.tensor(r)
        attention_BT[i, : len(r)] = 1
        weights_BT[i, first - 1 : len(r) - 1] = torch.randn(len(r) - first, generator=g)
    return tokens_BT, attention_BT, weights_BT


def _step(model, tokens_BT, attention_BT, weights_BT, groups=(), padding_free=True, fused=True, first_scored=0):
    model.zero_grad(set_to_none=True)
    logprobs_BT, entropy_BT = token_logprobs(
        model, tokens_BT, attention_BT, 0.7, first_scored, entropy_grad=True, fused_head=fused,
        padding_free=padding_free, prefix_groups=groups,
    )  # fmt: skip
    real_BT = (attention_BT[:, :-1] * attention_BT[:, 1:]).bool()
    if first_scored:
        real_BT[:, :first_scored] = False
    loss = (weights_BT * logprobs_BT).sum() + 0.3 * (entropy_BT * real_BT).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs_BT.detach() * real_BT, entropy_BT.detach() * real_BT, grads


def _groups_of(tokens_BT, attention_BT, dense):
    rows = [row[:n] for row, n in zip(tokens_BT.tolist(), attention_BT.sum(1).tolist())]
    groups = shared_prefix_groups(rows, CHEAP_CALLS)
    return [PrefixGroup(g.rows, g.prefix, dense) for g in groups]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("G", [2, 3, 8])
@pytest.mark.parametrize("dense", [True, False])
def test_shared_forwards_equal_each_row_computed_whole(G, dense):
    model = _tiny()
    batch = _grouped_batch(model.config.vocab_size, G)
    groups = _groups_of(batch[0], batch[1], dense)
    assert len(groups) == 2 and all(g.prefix >= 9 and len(g.rows) == G for g in groups)
    shared = _step(model, *batch, groups=groups)
    assert_same_forward(shared, _step(model, *batch))  # packed, every row whole
    assert_same_forward(shared, _step(model, *batch, padding_free=False))  # padded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fused", [True, False])
def test_sharing_with_the_prompt_skipped_and_either_head(fused):
    model = _tiny()
    batch = _grouped_batch(model.config.vocab_size, 4, seed=3)
    groups = _groups_of(batch[0], batch[1], dense=False)
    # From column 8 on: the prefix's last row (column 8) is the first prediction any row scores.
    assert_same_forward(
        _step(model, *batch, groups=groups, fused=fused, first_scored=8),
        _step(model, *batch, fused=fused, first_scored=8),
    )


@pytest.mark.timeout(120)
def test_rows_whose_earlier_turns_differ_share_only_what_they_have_in_common():
    # Multi-turn rows: the same first user turn, different assistant turns, then the same second user
    # turn. Only the first turn is common; the later equal turn sits at different places and is not shared.
    model = _tiny()
    first, second = [5, 6, 7, 8, 9, 10], [30, 31, 32]
    rows = [first + [40, 41] + second + [50], first + [42] + second + [51, 52], first + [43, 44, 45] + second]
    T = max(map(len, rows))
    tokens_BT = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attention_BT = (torch.arange(T)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    groups = shared_prefix_groups([r for r in rows], CHEAP_CALLS)
    assert [(g.rows, g.prefix) for g in groups] == [((0, 1, 2), len(first))]
    weights_BT = torch.randn(3, T - 1, generator=torch.Generator().manual_seed(0)) * attention_BT[:, 1:]
    assert_same_forward(
        _step(model, tokens_BT, attention_BT, weights_BT, groups), _step(model, tokens_BT, attention_BT, weights_BT)
    )


@pytest.mark.timeout(120)
def test_a_lora_policy_shares_exactly():
    policy = lora_policy_that_moves(_tiny())
    batch = _grouped_batch(policy.config.vocab_size, 4, seed=5)
    groups = _groups_of(batch[0], batch[1], dense=False)
    shared = _step(policy, *batch, groups=groups)
    assert any("lora" in name for name in shared[2])
    assert_same_forward(shared, _step(policy, *batch))


@pytest.mark.timeout(120)
def test_a_model_without_segmented_sdpa_computes_each_row_whole(caplog):
    model = _tiny()
    model.config._attn_implementation = "eager"  # packs through transformers' mask: no shared layout
    batch = _grouped_batch(model.config.vocab_size, 3, seed=7)
    groups = _groups_of(batch[0], batch[1], dense=True)
    assert not packing_cost(model, "cpu").shares_prefixes
    with caplog.at_level(logging.DEBUG, logger="lit_grpo.maths.logprobs"):
        shared = _step(model, *batch, groups=groups)
    assert "shared prefixes off" in caplog.text
    assert_same_forward(shared, _step(model, *batch, padding_free=False))


@pytest.mark.timeout(60)
def test_the_plan_shares_where_it_pays_and_counts_what_it_saved():
    model = _tiny()
    tokens_BT, attention_BT, _ = _grouped_batch(model.config.vocab_size, 4, prompt_len=9)
    cost = packing_cost(model, "cpu")
    assert cost.shares_prefixes and cost.flops_per_pair > 0
    B = tokens_BT.shape[0]
    plan = plan_forwards(attention_BT, [slice(0, B)], 0, 0, True, cost, tokens_BT, pack_always=True)
    (micro,) = plan.no_grad
    assert micro.packed and len(micro.prefix_groups) == 2
    # Each of the two 4-row groups shares at least its 9-token prompt.
    assert plan.prefix_tokens_saved == micro.prefix_tokens_saved >= 2 * 3 * 9
    lengths = attention_BT.sum(1).tolist()
    spans = plan.spans(plan.no_grad)
    assert sum(stop - start for start, stop in spans) == sum(lengths) - plan.prefix_tokens_saved
    # Without the tokens, or with sharing off, every row whole.
    assert plan_forwards(attention_BT, [slice(0, B)], 0, 0, True, cost, None, True).prefix_tokens_saved == 0
    off = packing_cost(model, "cpu", share_prefixes=False)
    assert plan_forwards(attention_BT, [slice(0, B)], 0, 0, True, off, tokens_BT, True).prefix_tokens_saved == 0
    # A saving makes packing pay where padding alone would not.
    assert PackingCost(1.0, 10.0).pays([4, 4], 4, shared_saving=25.0)
    assert not PackingCost(1.0, 10.0).pays([4, 4], 4)
