"""Token-budget micro-batches (`micro_batch_max_tokens`): the plan, the gradient it leaves
unchanged, the memory it bounds, `perf/padding_frac`, and the sequences longer than the budget
(counted, said once at run time, and named at start-up when the config allows them)."""

from __future__ import annotations

import logging
import random

import lightning as L
import pytest
import torch
from conftest import compose_config
from torch.utils.data import DataLoader

from lit_grpo.build import build_run
from lit_grpo.config import ineffective_knobs
from lit_grpo.loop import metrics as metrics_py
from lit_grpo.loop.metrics import merge_step_metrics
from lit_grpo.loop.micro_batches import TEXT_FILLER, filler_micro_batch, plan_token_budget, sequence_lengths
from lit_grpo.loop.module import GRPOModule
from lit_grpo.models.load import load_policy, load_tokenizer
from lit_grpo.run.validate import validate
from lit_grpo.types import MultiModalBatch, RolloutBatch, RolloutRecord

# ------------------------------------------------------------------ the plan


@pytest.mark.timeout(10)
def test_the_plan_is_first_fit_over_rows_longest_first():
    # Worked by hand, budget 24, rows longest first: 6 (30), 1 (12), 4 (12), 3 (7), 0 (5), 2 (3), 5 (2).
    #   6: nothing open                          -> A = [6], width 30 (30 > 24: over budget, alone)
    #   1: A: 2 x 30 = 60 > 24                   -> B = [1], width 12
    #   4: A: 60; B: 2 x 12 = 24 <= 24           -> B = [1, 4]
    #   3: A: 60; B: 3 x 12 = 36                 -> C = [3], width 7
    #   0: C: 2 x 7 = 14                         -> C = [3, 0]
    #   2: C: 3 x 7 = 21                         -> C = [3, 0, 2]
    #   5: C: 4 x 7 = 28 > 24                    -> D = [5], width 2
    lengths = [5, 12, 3, 7, 12, 2, 30]
    assert plan_token_budget(lengths, 24) == [[6], [1, 4], [0, 2, 3], [5]]
    # At most 2 rows each as well: C closes at [3, 0], so row 2 opens D (width 3) and row 5 joins it (2 x 3 = 6).
    assert plan_token_budget(lengths, 24, max_sequences=2) == [[6], [1, 4], [0, 3], [2, 5]]
    # Equal lengths go in row order; a budget met exactly is within it; a lone row over it goes alone.
    assert plan_token_budget([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert plan_token_budget([9, 8], 8) == [[0], [1]]
    assert plan_token_budget([], 8) == []


def first_fit_reference(lengths: list[int], budget: int, cap: int) -> list[list[int]]:
    """First-fit decreasing as the textbook has it: every open micro-batch tried, oldest first."""
    bins: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        for rows in bins:
            if (cap == 0 or len(rows) < cap) and (len(rows) + 1) * max(lengths[r] for r in rows + [row]) <= budget:
                rows.append(row)
                break
        else:
            bins.append([row])
    return [sorted(rows) for rows in bins]


@pytest.mark.timeout(10)
def test_every_row_once_and_the_budget_held_except_by_a_lone_outlier():
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        budget, cap = rng.randint(8, 128), rng.choice([0, 1, 3])
        plan = plan_token_budget(lengths, budget, cap)
        assert sorted(row for rows in plan for row in rows) == list(range(len(lengths)))
        for rows in plan:
            assert rows == sorted(rows)
            assert cap == 0 or len(rows) <= cap
            padded = len(rows) * max(lengths[row] for row in rows)
            assert padded <= budget or (len(rows) == 1 and lengths[rows[0]] > budget), (lengths, budget, rows)
        assert plan == first_fit_reference(lengths, budget, cap)
        assert plan_token_budget(list(lengths), budget, cap) == plan  # deterministic


@pytest.mark.timeout(10)
def test_the_packed_plan_is_first_fit_over_real_tokens():
    # Packed, a micro-batch costs its rows' lengths, not rows x the longest. Budget 24, rows longest
    # first: 6 (30), 1 (12), 4 (12), 3 (7), 0 (5), 2 (3), 5 (2).
    #   6: alone, over budget -> A = [6] (30);  1 -> B = [1] (12);  4: B 12 + 12 = 24 -> B = [1, 4] (24)
    #   3: A full, B full -> C = [3] (7);  0 -> C (12);  2 -> C (15);  5 -> C (17)
    lengths = [5, 12, 3, 7, 12, 2, 30]
    assert plan_token_budget(lengths, 24, packed=True) == [[6], [1, 4], [0, 2, 3, 5]]
    # Every open micro-batch is tried, the oldest first: 3 fills A (10 + 3 = 13), the older one.
    assert plan_token_budget([10, 9, 3, 5], 14, packed=True) == [[0, 2], [1, 3]]
    assert plan_token_budget([4, 4, 4, 4, 4], 8, max_sequences=1, packed=True) == [[0], [1], [2], [3], [4]]
    assert plan_token_budget([], 8, packed=True) == []


@pytest.mark.timeout(10)
def test_the_packed_plan_holds_every_row_once_within_the_budget():
    rng = random.Random(1)
    for _ in range(300):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        budget, cap = rng.randint(8, 128), rng.choice([0, 1, 3])
        plan = plan_token_budget(lengths, budget, cap, packed=True)
        assert sorted(row for rows in plan for row in rows) == list(range(len(lengths)))
        for rows in plan:
            assert cap == 0 or len(rows) <= cap
            total = sum(lengths[row] for row in rows)
            assert total <= budget or (len(rows) == 1 and lengths[rows[0]] > budget), (lengths, budget, rows)
        # Never more micro-batches than the padded plan of the same budget.
        assert len(plan) <= len(plan_token_budget(lengths, budget, cap))


@pytest.mark.timeout(10)
def test_the_plan_refuses_a_budget_below_one_token():
    with pytest.raises(ValueError, match="max_tokens"):
        plan_token_budget([3, 4], 0)
    with pytest.raises(ValueError, match="max_sequences"):
        plan_token_budget([3, 4], 8, -1)


@pytest.mark.timeout(10)
def test_a_filler_of_a_batch_with_images_is_a_whole_row_with_its_images():
    # FSDP2's filler forwards: two tokens of row 0 for text; with images, the first row that has
    # some, whole, so that its forward runs the vision tower on all of that image's tokens.
    attention = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    assert filler_micro_batch(attention) == TEXT_FILLER
    image = {"pixel_values": torch.ones(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    filler = filler_micro_batch(attention, MultiModalBatch.of([None, image, image]))
    assert filler.filler and filler.rows == slice(1, 2) and filler.width == 4
    assert filler.vision(MultiModalBatch.of([None, image, image]))["pixel_values"].shape == (4, 2)


def test_sequence_lengths_run_to_the_last_real_token():
    attention = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 1, 1, 0]])
    assert sequence_lengths(attention) == [3, 5, 1, 4]  # left padding keeps its leading zeros


# ------------------------------------------------------------------ the module, on fixed batches

T = 40
LENGTHS = [40, 7, 12, 5, 23, 9, 16, 3]
"""Ragged rows of one batch (T = 40): prompts of 2 tokens, the rest trained on."""


def ragged_batch(lengths: list[int], vocab: int, seed: int, width: int = T, per_token: bool = False) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    size = len(lengths)
    position = torch.arange(width)[None]
    attention = (position < torch.tensor(lengths)[:, None]).long()
    loss_mask = ((position >= 2) & (attention > 0)).float()
    tokens = torch.randint(3, vocab, (size, width), generator=g) * attention
    advantages_B = torch.randn(size, generator=g)
    return RolloutBatch(
        tokens_BT=tokens,
        attention_mask_BT=attention,
        loss_mask_BT=loss_mask,
        # Off the trainer's logprobs, so the TIS weights and the drift metrics are not all 1 and 0.
        sampler_logprobs_BT=-(torch.rand(size, width, generator=g) * 3 + 1) * loss_mask,
        advantages_B=advantages_B,
        rewards_B=torch.rand(size, generator=g, dtype=torch.float64),
        versions_B=torch.zeros(size, dtype=torch.long),
        advantages_BT=torch.randn(size, width, generator=g) * loss_mask if per_token else None,
    )


class Steps(L.Callback):
    """Sets each rollout step's loss normalization; keeps each optimizer step's gradient and drops it,
    so the weights never move and every step starts from the same policy; keeps each step's metrics."""

    def __init__(self, normalizations: list[str]) -> None:
        self.normalizations = normalizations
        self.grads: list[dict[str, torch.Tensor]] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = pl_module.rollout_step
        if step < len(self.normalizations):
            pl_module.config.policy_loss.loss_normalization = self.normalizations[step]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({k: p.grad.detach().clone() for k, p in pl_module.policy.named_parameters()})
        for p in pl_module.policy.parameters():
            p.grad = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.metrics.append({k: float(v) for k, v in pl_module.last_step.train_metrics.items()})


def fit_on(batches: list[RolloutBatch], tmp_path, *overrides: str, callbacks=()) -> GRPOModule:
    """Train a fresh tiny policy (seed 0) one rollout step per batch, without a sampler."""
    c = validate(compose_config("optim.grad_clip_norm=0", "logger=none", *overrides, output_dir=tmp_path))
    L.seed_everything(0, verbose=False)
    tokenizer = load_tokenizer(c.model)
    module = GRPOModule(load_policy(c.model, tokenizer, c.seed), c)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return module


def vocab_size() -> int:
    return len(load_tokenizer(validate(compose_config()).model))


@pytest.mark.timeout(300)
def test_the_gradient_is_the_whole_batch_one_whatever_the_cut(tmp_path):
    # Per normalization, per-sequence then per-token advantages: one rollout step each, two PPO
    # minibatches each (so `old` comes from the no-gradient forward), kl_beta > 0 (so does the
    # reference's). Whole batch: one forward of 4 rows x 40 tokens per optimizer step. With 48
    # tokens, minibatch 1 (lengths 40, 7, 12, 5) runs [40] and [12, 7, 5] cut to 12 tokens, minibatch 2
    # (23, 9, 16, 3) runs [23, 16] cut to 23 and [9, 3] cut to 9. Normalizers per micro-batch, a
    # mask or advantages shifted by the cut, `old` or the reference written back to the wrong
    # columns: each changes the gradient far beyond float32 rounding. The metrics, token means
    # weighted by each micro-batch's tokens, come out the same too.
    normalizations = ["token_mean", "seq_mean", "sum"] * 2
    vocab = vocab_size()
    batches = [ragged_batch(LENGTHS, vocab, seed=i, per_token=i >= 3) for i in range(6)]
    common = ("batching.ppo_minibatches=2", "policy_loss.kl_beta=0.1")
    grads, metrics = {}, {}
    cuts = {
        "whole": ("batching.micro_batch_size=0", "batching.padding_free=false"),
        "budget": ("batching.micro_batch_max_tokens=48", "batching.padding_free=false"),
        "budget_and_rows": (
            "batching.micro_batch_max_tokens=48", "batching.micro_batch_size=2", "batching.padding_free=false",
        ),
        # Packed (padding-free): each micro-batch one row of its sequences, the budget in real tokens.
        "packed": ("batching.micro_batch_size=0", "batching.padding_free=true"),
        "packed_budget": ("batching.micro_batch_max_tokens=48", "batching.padding_free=true"),
        "packed_rows": ("batching.micro_batch_size=3", "batching.padding_free=true"),
    }  # fmt: skip
    for name, cut in cuts.items():
        steps = Steps(normalizations)
        fit_on(batches, tmp_path / name, *common, *cut, callbacks=[steps])
        assert len(steps.grads) == 12  # 6 rollout steps x 2 minibatches
        grads[name], metrics[name] = steps.grads, steps.metrics
    for i, whole in enumerate(grads["whole"]):
        scale = max(g.abs().max() for g in whole.values()).item()  # `sum` has gradients far above 1
        assert scale > 0
        for name in set(cuts) - {"whole"}:
            worst = max((whole[k] - grads[name][i][k]).abs().max().item() for k in whole)
            assert worst <= 1e-6 * max(1.0, scale), (name, normalizations[i // 2], i, worst, scale)
    for step, whole in enumerate(metrics["whole"]):
        keys = {"train/loss", "train/entropy", "train/drift/k1", "train/ref_kl", "train/correction/weight_mean"}
        assert keys <= set(whole)
        for name in set(cuts) - {"whole"}:
            budgeted = {k: v for k, v in metrics[name][step].items() if k != "train/micro_batches_over_budget"}
            assert budgeted == pytest.approx(whole, rel=1e-5, abs=1e-6), (name, step)


class RecordForwards(L.Callback):
    """Each forward's input shape (the policy's and the reference's), and under autograd the bytes
    of the tensors it saves for backward (activations, logits; not the weights) until the next
    forward starts. `pack` is the pack hook of `torch.autograd.graph.saved_tensors_hooks`, around the fit."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.saved_bytes: list[int] = []  # one per forward under autograd
        self._storages: set[int] = set()
        self._weights: set[int] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        self._weights = {p.untyped_storage().data_ptr() for p in pl_module.policy.parameters()}
        # On the decoder: it runs in every forward, whereas the fused LM head never calls the causal LM's own.
        for model in (pl_module.policy, pl_module.reference):
            model.get_decoder().register_forward_pre_hook(self._before, with_kwargs=True)

    def _before(self, module, args, kwargs) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        if torch.is_grad_enabled():
            self.saved_bytes.append(0)
            self._storages = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if self.saved_bytes and key not in self._weights and key not in self._storages:
            self._storages.add(key)
            self.saved_bytes[-1] += storage.nbytes()
        return tensor


@pytest.mark.timeout(300)
def test_a_long_outlier_does_not_set_the_memory_of_every_forward(tmp_path):
    # Seven short rows and one of 96 tokens. Padded to the batch, every forward is 8 x 96; with a
    # 32-token budget each forward but the outlier's own (1 x 96) holds <= 32 token slots, and what
    # a forward keeps for backward shrinks with it.
    lengths = [6, 96, 9, 4, 12, 7, 10, 5]
    batch = ragged_batch(lengths, vocab_size(), seed=0, width=96)
    runs = {}
    for budget, packed in ((0, False), (32, False), (32, True)):
        record = RecordForwards()
        with torch.autograd.graph.saved_tensors_hooks(record.pack, lambda tensor: tensor):
            fit_on(
                [batch],
                tmp_path / f"{budget}-{packed}",
                "policy_loss.kl_beta=0.1",  # the reference's forwards go through the same micro-batches
                f"batching.micro_batch_max_tokens={budget}",
                f"batching.padding_free={str(packed).lower()}",
                "batching.pack_only_where_it_pays=false",  # the tiny model would stay padded (next test)
                "batching.share_prefixes=false",  # random rows that begin alike would share a token or two
                callbacks=[record],
            )
        runs[budget, packed] = record
    whole, budgeted, packed = runs[0, False], runs[32, False], runs[32, True]
    # Packed, by hand: 96 alone, [12, 10, 9] (31 tokens), [7, 6, 5, 4] (22): one row each, no padding.
    assert packed.shapes == [(1, 96), (1, 31), (1, 22)] * 2
    assert max(packed.saved_bytes) < whole.saved_bytes[0] / 4, (packed.saved_bytes, whole.saved_bytes)
    assert whole.shapes == [(8, 96)] * 2  # the reference's forward, then the policy's
    for rows, width in budgeted.shapes:
        assert rows * width <= 32 or (rows, width) == (1, 96), budgeted.shapes
    # By hand, rows longest first 96, 12, 10, 9, 7, 6, 5, 4: [96], [12, 10] (24), [9, 7, 6] (27), [5, 4] (10),
    # each cut to its longest row; the reference's pass, then the policy's, the same.
    assert budgeted.shapes == [(1, 96), (2, 12), (3, 9), (2, 5)] * 2
    # Activations: the largest training forward is the outlier's, about 1/8 of the padded batch's.
    assert len(whole.saved_bytes) == 1 and len(budgeted.saved_bytes) > 1
    assert max(budgeted.saved_bytes) < whole.saved_bytes[0] / 4, (budgeted.saved_bytes, whole.saved_bytes)


@pytest.mark.timeout(300)
def test_a_sequence_over_the_budget_is_counted_and_said_once(tmp_path, caplog):
    # A 32-token budget: step 1 has two sequences longer than it (96 and 40 tokens), step 2 one
    # (50), step 3 none. Each goes alone, over the budget: counted every step, warned the first time
    # with the longest one's length, the budget and the bound that would hold every forward.
    vocab = vocab_size()
    lengths = [[6, 96, 9, 40], [6, 50, 9, 4], [6, 7, 9, 4]]
    batches = [ragged_batch(rows, vocab, seed=i, width=96) for i, rows in enumerate(lengths)]
    steps = Steps([])
    with caplog.at_level(logging.WARNING, logger="lit_grpo.loop.micro_batches"):
        fit_on(
            batches, tmp_path / "budget", "batching.micro_batch_max_tokens=32", "data.max_seq_len=96", callbacks=[steps]
        )
    assert [m["train/micro_batches_over_budget"] for m in steps.metrics] == [2.0, 1.0, 0.0]
    said = [r.getMessage() for r in caplog.records if "micro_batch_max_tokens" in r.getMessage()]
    assert said == [
        "step 1: a sequence of 96 tokens is longer than batching.micro_batch_max_tokens=32, so it goes through "
        "a forward and backward of its own, over the budget (a sequence cannot be split; counted in "
        "train/micro_batches_over_budget, said once): set batching.micro_batch_max_tokens to at least "
        "data.max_seq_len=96 to bound every forward"
    ]
    steps = Steps([])
    fit_on(batches[:1], tmp_path / "off", callbacks=[steps])  # no budget: nothing to count
    assert "train/micro_batches_over_budget" not in steps.metrics[0]


def test_a_budget_below_the_longest_sequence_allowed_is_named_at_start_up(tmp_path):
    def knobs(*overrides):
        return ineffective_knobs(validate(compose_config("data.max_seq_len=64", *overrides, output_dir=tmp_path)))

    assert knobs("batching.micro_batch_max_tokens=64") == knobs("batching.micro_batch_max_tokens=0") == []
    (note,) = knobs("batching.micro_batch_max_tokens=48")
    assert note.startswith(
        "batching.micro_batch_max_tokens=48 is below data.max_seq_len=64: a sequence longer than the budget"
    )


# ------------------------------------------------------------------ perf/padding_frac


@pytest.mark.timeout(300)
def test_padding_frac_counts_the_token_slots_the_forwards_computed(tmp_path):
    # LENGTHS hold 115 real tokens. Padded to T = 40, the forward is 8 x 40 = 320 slots. With 48
    # tokens (rows longest first: 40, 23, 16, 12, 9, 7, 5, 3) the plan is [40], [23, 16] (2 x 23 = 46),
    # [12, 9, 7, 5] (4 x 12 = 48), [3]: 40 + 46 + 48 + 3 = 137 slots.
    batch = ragged_batch(LENGTHS, vocab_size(), seed=0)
    assert sum(LENGTHS) == 115
    fracs = {}
    # Packed (padding-free), whatever the budget, the slots are the real tokens.
    for budget, packed, slots in [(0, False, 320), (48, False, 137), (0, True, 115), (48, True, 115)]:
        module = fit_on(
            [batch],
            tmp_path / f"{budget}-{packed}",
            f"batching.micro_batch_max_tokens={budget}",
            f"batching.padding_free={str(packed).lower()}",
            "batching.pack_only_where_it_pays=false",  # every micro-batch packed (the tiny model's would not pay)
        )
        timings = module.last_step.timings
        assert (timings["train_tokens"], timings["train_token_slots"]) == (115.0, slots)
        merged = merge_step_metrics(RolloutRecord(), module.last_step.train_metrics, timings)
        fracs[budget, packed] = merged["perf/padding_frac"]
        assert fracs[budget, packed] == pytest.approx(1 - 115 / slots, abs=1e-12)
    assert fracs[48, False] < fracs[0, False] and fracs[0, True] == fracs[48, True] == 0


@pytest.mark.timeout(30)
def test_padding_frac_adds_up_the_ranks_slots(monkeypatch):
    # Rank 0: 90 real tokens in 100 slots; rank 1: 10 in 300. Together 1 - 100 / 400 = 0.75, where the
    # mean of the ranks' fractions would be (0.1 + 0.967) / 2.
    ranks = [{"train_tokens": 90.0, "train_token_slots": 100.0}, {"train_tokens": 10.0, "train_token_slots": 300.0}]
    monkeypatch.setattr(metrics_py, "all_gather_objects", lambda obj: [(obj[0], t) for t in ranks])
    merged = merge_step_metrics(RolloutRecord(), {}, ranks[0])
    assert merged["perf/padding_frac"] == pytest.approx(0.75)


@pytest.mark.timeout(300)
def test_padding_frac_reaches_the_step_metrics(tmp_path):
    # A real run (sampler, step sequence): the step's metrics, those the loggers get, carry it.
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "trainer.fast_dev_run=1",
            "trainer.enable_progress_bar=false",
            "sampler.max_completion_tokens=3",
            "batching.micro_batch_max_tokens=16",
            output_dir=tmp_path,
        )
    )
    trainer, module, datamodule = build_run(c)
    trainer.fit(module, datamodule=datamodule)
    (step,) = module.step_sequence.history.steps
    timings = module.last_step.timings
    assert step["perf/padding_frac"] == pytest.approx(1 - timings["train_tokens"] / timings["train_token_slots"])
    assert 0 <= step["perf/padding_frac"] < 1


# ------------------------------------------------------------------ packing only where it pays


@pytest.mark.timeout(10)
def test_packing_pays_when_the_padding_saved_outweighs_the_calls_added():
    from lit_grpo.maths.packing import PackingCost

    # Rows of 3, 5 and 10 tokens padded to 10: 30 slots, 18 real, 12 of padding.
    # Saved: 12 x 1e6 = 12e6 FLOPs; added: 3 sequences' calls.
    assert PackingCost(flops_per_token=1e6, flops_per_sequence=4e6 - 1).pays([3, 5, 10], 10)
    assert not PackingCost(1e6, 4e6).pays([3, 5, 10], 10)  # 12e6 against 12e6: no gain, padded
    assert not PackingCost(1e6, 1.0).pays([10, 10, 10], 10)  # no padding to save
    assert PackingCost(1e6, 0.0).pays([3, 10], 10)  # free calls: any padding saved pays
    assert not PackingCost(1e6, 0.0).pays([10, 10], 10)


@pytest.mark.timeout(60)
def test_a_models_packing_cost_counts_its_layers_weights_and_calls():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_grpo.maths.packing import SEGMENT_CALL_FLOPS, packing_cost

    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    # By hand, per layer: q 16x16, k and v 16x8 each (2 kv heads of 4), o 16x16, gate, up, down 16x24
    # each, two norms of 16: 256 + 128 + 128 + 256 + 3 x 384 + 32 = 1,952; 3 layers and the final norm
    # (16): 5,872 weights a token multiplies (the embedding and the 50 x 16 head excluded), 2 FLOPs each.
    cost = packing_cost(model, "cpu")
    assert cost.flops_per_token == 2 * 5_872
    # sdpa on plain causal layers: SEGMENTED_SDPA, one call per sequence and layer.
    assert cost.flops_per_sequence == 3 * SEGMENT_CALL_FLOPS["cpu"]


@pytest.mark.timeout(300)
def test_the_tiny_models_short_rows_stay_padded_unless_packing_is_forced(tmp_path):
    # The tiny model's token costs a few thousand FLOPs: saving 205 padding slots is worth less than
    # 8 sequences' attention calls, so the default pads; pack_only_where_it_pays=false packs.
    batch = ragged_batch(LENGTHS, vocab_size(), seed=0)
    slots = {}
    for rule in ("true", "false"):
        module = fit_on(
            [batch], tmp_path / rule, "batching.padding_free=true", f"batching.pack_only_where_it_pays={rule}"
        )
        slots[rule] = module.last_step.timings["train_token_slots"]
        assert module.packing_cost is not None  # which rows may share a prefix, whether packing pays or not
    assert slots == {"true": 8 * 40, "false": 115}
