"""Rows of advantage 0 left out of the training forwards (`batching.skip_zero_advantage_rows`): which
losses allow it, the plan that leaves them out, and the gradient that does not change."""

from __future__ import annotations

import pytest
import torch
from test_losses import BUILTIN
from test_micro_batches import Steps, fit_on, ragged_batch, vocab_size

from lit_grpo.loop.micro_batches import kept_rows, plan_forwards
from lit_grpo.maths.losses import POLICY_LOSSES, policy_loss
from lit_grpo.maths.packing import PackingCost

# ------------------------------------------------------------------ which losses


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", BUILTIN)
def test_a_loss_says_it_vanishes_without_advantage_exactly_when_it_does(name):
    # Off-policy inputs (old and the sampler away from π, so dro's squared log-ratio pulls, and the
    # TIS weights are not 1), half the rows with advantage 0: the flag must say whether those rows'
    # gradient is exactly 0.
    g = torch.Generator().manual_seed(0)
    B, S = 6, 5
    logprobs = (-torch.rand(B, S, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logprobs.detach() + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.3
    sampler = old + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.2
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    advantages[::2] = 0.0
    mask = torch.ones(B, S, dtype=torch.float64)
    mask[1, 3:] = 0.0
    loss, _ = policy_loss(
        name, logprobs=logprobs, old_logprobs=old, sampler_logprobs=sampler, ref_logprobs=None,
        advantages=advantages, mask=mask, kl_beta=0.0,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad[1::2].abs().sum() > 0  # the rows with an advantage learn
    vanishes = bool(grad[::2].abs().sum() == 0)
    assert POLICY_LOSSES[name].vanishes_without_advantage == vanishes
    if name == "dro":
        assert not vanishes  # its proximal term moves π back to old whatever the advantage


# ------------------------------------------------------------------ the plan


def rows_of(micros) -> list[int]:
    out = []
    for micro in micros:
        rows = micro.rows
        out += list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()
    return out


@pytest.mark.timeout(10)
def test_the_plan_leaves_out_the_rows_not_trained_in_every_pass():
    lengths = [6, 3, 5, 4, 7, 2]
    attention_BT = (torch.arange(8)[None] < torch.tensor(lengths)[:, None]).long()
    trained = [True, False, True, False, False, False]
    halves = [slice(0, 3), slice(3, 6)]
    for padding_free in (False, True):
        for size, budget in ((0, 0), (1, 0), (0, 12)):
            plan = plan_forwards(attention_BT, halves, size, budget, padding_free, trained=trained)
            first, second = (rows_of(micros) for micros in plan.per_minibatch)
            assert sorted(first) == [0, 2]
            assert second == [3]  # none of its rows trains: it keeps its first, for the collectives
            assert sorted(rows_of(plan.no_grad)) == [0, 2, 3]
            assert plan.token_slots == ((6 + 5 + 4) if padding_free else sum(m.token_slots for m in plan.no_grad)), (
                padding_free,
                size,
                budget,
            )
    everything = plan_forwards(attention_BT, halves, 0, 0, True, trained=[True] * 6)
    assert [m.rows for m in everything.per_minibatch[0]] == [slice(0, 3)]  # all trained: views, as without
    assert kept_rows(slice(0, 3), None) is None


@pytest.mark.timeout(10)
def test_kept_rows_still_share_their_prompt():
    # Rows 0-3 and 4-7 are two groups of one 5-token prompt; rows 1 and 5-7 are left out.
    prompt_a, prompt_b = [5, 6, 7, 8, 9], [9, 8, 7, 6, 5]
    rows = [prompt_a + [10 + i, 11] for i in range(4)] + [prompt_b + [20 + i, 21] for i in range(4)]
    tokens_BT = torch.tensor(rows)
    attention_BT = torch.ones_like(tokens_BT)
    cost = PackingCost(flops_per_token=1e9, flops_per_sequence=0.0, flops_per_pair=1.0, shares_prefixes=True)
    trained = [True, False, True, True, False, False, False, True]
    plan = plan_forwards(attention_BT, [slice(0, 8)], 0, 0, True, cost, tokens_BT, pack_always=True, trained=trained)
    (micro,) = plan.per_minibatch[0]
    assert micro.rows.tolist() == [0, 2, 3, 7]
    assert plan.prefix_tokens_saved == 2 * 5  # rows 0, 2, 3 share prompt a; row 7 is alone


# ------------------------------------------------------------------ the module


def zero_some(batch, rows: list[int]):
    """`batch` with advantage 0 on `rows` (per sequence, and per token when it has them)."""
    batch.advantages_B[rows] = 0.0
    if batch.advantages_BT is not None:
        batch.advantages_BT[rows] = 0.0
    return batch


class Rows(Steps):
    """`Steps`, and the rows of every forward of the policy's decoder."""

    def __init__(self) -> None:
        super().__init__([])
        self.forward_rows: list[int] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.policy.get_decoder().register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"]
        position_ids = kwargs.get("position_ids")
        packed = ids.shape[0] == 1 and position_ids is not None
        # A packed row holds its sequences one after the other, each restarting its positions at 0.
        self.forward_rows.append(int((position_ids == 0).sum()) if packed else ids.shape[0])


@pytest.mark.timeout(300)
def test_leaving_out_rows_of_advantage_zero_keeps_the_gradient_and_the_loss(tmp_path):
    # Per-sequence then per-token advantages, rows 1, 3 and 6 of 8 at 0, padded and packed, one
    # and two minibatches: the gradient and the loss with the rows left out must equal those with
    # every row computed, and the forwards must see 5 rows (of 8) where they are left out.
    vocab = vocab_size()
    zeroed = [1, 3, 6]
    cuts = {
        "padded": ("batching.padding_free=false",),
        "packed": ("batching.padding_free=true",),
        "budget": ("batching.micro_batch_max_tokens=48", "batching.padding_free=true"),
        "minibatches": ("batching.ppo_minibatches=2", "batching.padding_free=true"),
    }
    for cut_name, cut in cuts.items():
        runs = {}
        for skip in (False, True):
            batches = [zero_some(ragged_batch([40, 7, 12, 5, 23, 9, 16, 3], vocab, seed=i, per_token=i == 1), zeroed)
                       for i in range(2)]  # fmt: skip
            rows = Rows()
            module = fit_on(
                batches, tmp_path / f"{cut_name}-{skip}", "policy_loss.kl_beta=0",
                f"batching.skip_zero_advantage_rows={str(skip).lower()}", *cut, callbacks=[rows],
            )  # fmt: skip
            runs[skip] = (rows, module)
        (full, _), (skipped, module) = runs[False], runs[True]
        assert len(full.grads) == len(skipped.grads) > 0
        for whole, left_out in zip(full.grads, skipped.grads):
            scale = max(g.abs().max() for g in whole.values()).item()
            worst = max((whole[k] - left_out[k]).abs().max().item() for k in whole)
            assert scale > 0 and worst <= 1e-6 * max(1.0, scale), (cut_name, worst, scale)
        for a, b in zip(full.metrics, skipped.metrics):
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7), cut_name
            if cut_name != "minibatches":  # anchored on the policy itself: a ratio of 1, a mean over the rows computed
                assert b["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5), cut_name
        # Every pass (the training ones, and `old`'s with two minibatches) sees rows 0, 2, 4, 5, 7 only.
        assert sum(skipped.forward_rows) * 8 == sum(full.forward_rows) * 5, (cut_name, full.forward_rows)
        assert module.last_step.timings["rows_skipped"] == 3.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides",
    [("policy_loss.kl_beta=0.1",), ("policy_loss=dro", "policy_loss.kl_beta=0"),
     ("policy_loss.kl_beta=0", "entropy.coef=0.01"), ("policy_loss.kl_beta=0", "entropy.top_quantile=0.5")],
)  # fmt: skip
def test_no_row_is_left_out_where_a_row_of_advantage_zero_has_a_gradient(tmp_path, overrides):
    batch = zero_some(ragged_batch([40, 7, 12, 5, 23, 9, 16, 3], vocab_size(), seed=0), [1, 3, 6])
    module = fit_on([batch], tmp_path, *overrides)
    assert module.last_step.timings["rows_skipped"] == 0.0
