"""Model FLOPs and their utilization (`perf/mfu`): the counts of `lit_grpo.maths.flops` against a
hand count and against torch's own `FlopCounterMode` on real transformers models, the peak
(`lit_grpo.run.peak`: the CPU's measured and cached, the cards' table), the metrics of a step
(`lit_grpo.loop.mfu`), and a short CPU run that logs them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config
from torch.utils.flop_counter import FlopCounterMode

from lit_grpo.build import build_run
from lit_grpo.loop.mfu import merge_flops, mfu_metrics
from lit_grpo.maths.flops import (
    ModelShape,
    backward_flops,
    causal_pairs,
    forward_flops,
    model_shape,
    sampling_flops,
    training_flops,
)
from lit_grpo.rollouts.pipeline import sampled_shape
from lit_grpo.run import peak
from lit_grpo.run.validate import validate
from lit_grpo.types import PromptGroup, RolloutSample

# 2 layers, hidden 8, 2 query heads and 1 key/value head of 4 dims, a gated MLP of 12, 32 ids.
TINY = ModelShape(
    hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=12, gated_mlp=True,
    vocab_size=32,
)  # fmt: skip
# Per token and layer, multiply-adds: q 8·(2·4) = 64, k 8·4 = 32, v 32, o (2·4)·8 = 64, MLP 3·8·12 = 288:
# 480, so 960 FLOPs a layer and 1,920 for the 2 layers. Per (query, key) pair and layer: Q·Kᵀ 2·2·4 = 16
# and P·V 16, so 32 a layer and 64 for both. The LM head: 2·8·32 = 512 a position.
PER_TOKEN, PER_PAIR, PER_HEAD_ROW = 1920, 64, 512


@pytest.mark.timeout(10)
def test_the_counts_equal_a_hand_count():
    assert TINY.weight_flops_per_token == PER_TOKEN
    assert TINY.head_flops(1) == PER_HEAD_ROW
    # A 5-token sequence: 1 + 2 + 3 + 4 + 5 = 15 causal pairs; the LM head over its last 3 positions.
    assert causal_pairs(0, 5) == 15
    forward = 5 * PER_TOKEN + 15 * PER_PAIR + 3 * PER_HEAD_ROW
    assert forward == 9600 + 960 + 1536 == 12096
    assert forward_flops(TINY, [(0, 5)], head_rows=3) == forward
    # Backward: 2x the weight matmuls (input and weight gradients), 2x attention (no weight).
    assert backward_flops(TINY, [(0, 5)], head_rows=3) == 2 * (9600 + 1536) + 2 * 960 == 24192
    # LoRA's frozen weights: their input gradient only (1x); attention stays 2x.
    assert backward_flops(TINY, [(0, 5)], head_rows=3, frozen_weights=True) == (9600 + 1536) + 2 * 960 == 13056
    assert training_flops(TINY, [5], head_rows=3) == (12096, 24192)
    # Two sequences are the sum of each.
    assert forward_flops(TINY, [(0, 5), (0, 2)], 4) == forward + 2 * PER_TOKEN + 3 * PER_PAIR + PER_HEAD_ROW


@pytest.mark.timeout(10)
def test_a_sliding_window_caps_the_keys_each_query_attends_to():
    # Window 4 over positions 0..9: 1 + 2 + 3 + 4, then 4 for each of the 6 others.
    assert causal_pairs(0, 10, window=4) == 10 + 24 == 34
    assert causal_pairs(3, 10, window=4) == 34 - (1 + 2 + 3)
    half = ModelShape(8, 2, 2, 1, 4, 12, True, 32, sliding_window=4, sliding_layers=1)
    # One full layer (55 pairs), one windowed (34), 32 FLOPs a pair in each.
    assert half.attention_flops((0, 10)) == 32 * (55 + 34)


@pytest.mark.timeout(10)
def test_decoding_with_a_kv_cache_costs_the_forward_of_the_same_tokens_but_the_head():
    # Token t decoded against a cache of t keys: its weights, its t + 1 pairs, one head row.
    decode = sum(forward_flops(TINY, [(t, t + 1)], head_rows=1) for t in range(3, 7))
    assert decode == forward_flops(TINY, [(0, 7)], 0) - forward_flops(TINY, [(0, 3)], 0) + 4 * PER_HEAD_ROW


@pytest.mark.timeout(10)
def test_a_shared_prompt_is_prefilled_once():
    # Two samples of a 3-token prompt, 5 and 6 tokens long, 2 and 3 generated. The shared prefill runs
    # prompt tokens 0..1 once: 2 tokens, 1 + 2 = 3 pairs. Then each sample runs positions 2 .. L-2 (its
    # last token is sampled, never fed back): 2 tokens and 3 + 4 = 7 pairs; 3 tokens and 3 + 4 + 5 = 12.
    # The head: one row per generated token, 5.
    shared = (2 + 2 + 3) * PER_TOKEN + (3 + 7 + 12) * PER_PAIR + 5 * PER_HEAD_ROW
    assert sampling_flops(TINY, [(3, [(5, 2), (6, 3)])]) == shared == 17408
    # Unshared, each runs positions 0 .. L-2: 4 + 5 tokens, 10 + 15 pairs.
    alone = (4 + 5) * PER_TOKEN + (10 + 15) * PER_PAIR + 5 * PER_HEAD_ROW
    assert sampling_flops(TINY, [(0, [(5, 2), (6, 3)])]) == alone
    assert alone - shared == 2 * PER_TOKEN + 3 * PER_PAIR  # the prompt's copy not recomputed


@pytest.mark.timeout(10)
def test_a_group_records_the_prompt_its_samples_share():
    def sample(tokens, mask):
        return RolloutSample(tokens=tokens, logprobs=[0.0] * len(tokens), loss_mask=mask, reward=0.0)

    same = [sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), sample([1, 2, 3, 7, 8, 9], [0, 0, 0, 1, 1, 1])]
    assert sampled_shape(PromptGroup(row={}, samples=same, version=0)) == (3, [(5, 2), (6, 3)])
    differ = [same[0], sample([1, 2, 4, 7], [0, 0, 0, 1])]
    assert sampled_shape(PromptGroup(row={}, samples=differ, version=0)) == (0, [(5, 2), (4, 1)])


def _tiny(model_type: str, **sizes):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=64, attn_implementation="eager", pad_token_id=0,
        bos_token_id=1, eos_token_id=2, **sizes,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _counted(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "model_type, sizes",
    [
        ("llama", {"num_key_value_heads": 2}),
        ("qwen2", {"num_key_value_heads": 1}),
        ("gemma3_text", {"num_key_value_heads": 2, "head_dim": 8}),  # head_dim set apart from hidden / heads
        ("phi", {}),  # a plain MLP (fc1, fc2)
        ("gpt_neox", {}),
    ],
)
def test_the_counts_agree_with_torchs_flop_counter(model_type, sizes):
    """torch's `FlopCounterMode` counts every matmul aten runs (mm, bmm, their backward), 2 FLOPs a
    multiply-add, as the counts here do; they agree exactly (integers, no tolerance) but for one
    known difference: eager attention computes the whole T x T score matrix and masks it after,
    so the counter finds T² pairs a sequence where the counts here take the causal half, T(T+1)/2.
    Eager, because the counter has no rule for the CPU's sdpa kernel (it would count no attention)."""
    model = _tiny(model_type, **sizes)
    shape, why_not = model_shape(model.config)
    assert shape is not None, why_not
    B, T = 2, 7
    tokens = torch.randint(3, 32, (B, T))
    masked_half = B * shape.num_layers * 4 * shape.num_heads * shape.head_dim * (T * T - causal_pairs(0, T))
    spans = [(0, T)] * B
    # Forward: every position through the LM head (the model's own logits).
    output = {}
    counted_forward = _counted(lambda: output.update(logits=model(input_ids=tokens, use_cache=False).logits))
    assert counted_forward == forward_flops(shape, spans, B * T) + masked_half
    # Backward with every weight trained: 2x the weight matmuls and 2x attention.
    counted_backward = _counted(lambda: output["logits"].float().square().mean().backward())
    assert counted_backward == backward_flops(shape, spans, B * T) + 2 * masked_half
    # Frozen weights (as LoRA's base): the input gradients only, from the embeddings on.
    model.requires_grad_(False)
    embeddings = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, use_cache=False).logits
    frozen = _counted(lambda: logits.float().square().mean().backward())
    assert frozen == backward_flops(shape, spans, B * T, frozen_weights=True) + 2 * masked_half


@pytest.mark.timeout(10)
def test_models_it_does_not_understand_are_not_counted():
    from transformers import AutoConfig

    for model_type, why in [("qwen2_moe", "mixture of experts"), ("mixtral", "mixture of experts"),
                            ("qwen2_vl", "vision-language"), ("gpt2", "not one of the dense families")]:  # fmt: skip
        shape, why_not = model_shape(AutoConfig.for_model(model_type))
        assert shape is None and why in why_not, (model_type, why_not)


# ------------------------------------------------------------------ the peak


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "name, dtype, tf32, card, tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, "H100 SXM", 989.4),
        ("NVIDIA H100 80GB HBM3", torch.float32, True, "H100 SXM", 494.7),
        ("NVIDIA H100 80GB HBM3", torch.float32, False, "H100 SXM", 66.9),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, "H100 PCIe", 756),
        ("NVIDIA H200", torch.float16, False, "H200 SXM", 989.4),
        ("NVIDIA A100-SXM4-40GB", torch.bfloat16, False, "A100", 312),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, "A100", 156),
        ("NVIDIA L40S", torch.bfloat16, False, "L40S", 362.05),
    ],
)
def test_a_known_card_has_its_dense_peak(name, dtype, tf32, card, tflops):
    assert peak.gpu_peak(name, dtype, tf32) == (card, pytest.approx(tflops * 1e12))


@pytest.mark.timeout(10)
def test_an_unknown_card_or_dtype_has_no_peak():
    for name in ("NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "Tesla T4", "NVIDIA GeForce RTX 4090"):
        assert peak.gpu_peak(name, torch.bfloat16, False) is None, name
    assert peak.gpu_peak("NVIDIA H100 80GB HBM3", torch.float64, False) is None
    assert peak.precision_dtype("bf16-mixed") is torch.bfloat16
    assert peak.precision_dtype("32-true") is torch.float32
    assert peak.precision_dtype("16-mixed") is torch.float16
    assert peak.precision_dtype("transformer-engine") is None


@pytest.mark.timeout(30)
def test_the_cpu_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = peak.roofline_cache_path()
    assert path == tmp_path / "lit_grpo" / "roofline.json"
    measured = peak.cpu_peak(torch.float32, 1)
    entry = json.loads(path.read_text())[peak.cache_key(torch.float32, 1)]
    assert entry["flops_per_s"] == measured > 1e8 and entry["how"] == "quick"

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(peak, "gemm_flops_per_s", no_measuring)
    assert peak.cpu_peak(torch.float32, 1) == measured
    assert "float32 | 1 thread" in peak.cache_key(torch.float32, 1)


# ------------------------------------------------------------------ the step's metrics


@pytest.mark.timeout(10)
def test_mfu_is_each_phases_flops_over_its_time_and_the_peak():
    per_rank = [{"sample_flops": 4e9, "train_flops": 6e9}, {"sample_flops": 2e9, "train_flops": 6e9, "ref_flops": 1e9}]
    metrics = {
        **merge_flops(per_rank),
        "perf/sample_s": 2.0,
        "perf/ref_s": 0.5,
        "perf/train_s": 3.0,
        "perf/step_s": 5.0,
    }
    assert metrics["perf/flops/sample"] == 6e9 and metrics["perf/flops/train"] == 12e9
    assert metrics["perf/flops/ref"] == 1e9
    # Two ranks of a 1 GFLOP/s peak: 2e9 FLOP/s in all.
    assert mfu_metrics(metrics, 1e9, world_size=2) == pytest.approx(
        {
            "perf/mfu/sample": 6e9 / (2.0 * 2e9),
            "perf/mfu/ref": 1e9 / (0.5 * 2e9),
            "perf/mfu/train": 12e9 / (3.0 * 2e9),
            "perf/mfu": (6e9 + 1e9 + 12e9) / (5.0 * 2e9),
        }
    )
    assert merge_flops([{}, {}]) == {} and mfu_metrics({"perf/step_s": 1.0}, 1e9, 1) == {}


@pytest.mark.timeout(120)
def test_a_short_cpu_run_logs_its_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a fresh cache: the run measures its peak
    c = validate(
        compose_config(
            "+experiment=arithmetic", "trainer.fast_dev_run=1", "trainer.enable_progress_bar=false",
            "policy_loss.kl_beta=0.01", output_dir=tmp_path,
        )
    )  # fmt: skip
    trainer, module, datamodule = build_run(c)
    trainer.fit(module, datamodule=datamodule)
    (step,) = module.step_sequence.history.steps
    for key in ("perf/mfu/train", "perf/mfu/sample", "perf/mfu/ref", "perf/mfu"):
        assert 0 < step[key] <= 1, (key, step[key])
    assert (tmp_path / "cache" / "lit_grpo" / "roofline.json").is_file()
    # The trained sequences whole, forward and backward, the fused head from each one's first trained token.
    samples = [s for g in module.last_step.groups for s in g.samples]
    head_rows = sum(len(s.tokens) - s.loss_mask.index(1) for s in samples)
    shape = module.flop_shape
    forward, backward = training_flops(shape, [len(s.tokens) for s in samples], head_rows)
    assert step["perf/flops/train"] == forward + backward
    assert step["perf/flops/ref"] == forward
    assert step["perf/mfu/train"] == pytest.approx(
        step["perf/flops/train"] / (step["perf/train_s"] * module.step_sequence.peak_flops_per_s)
    )
