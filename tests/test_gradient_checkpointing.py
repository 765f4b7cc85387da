"""Gradient checkpointing (`model.gradient_checkpointing`, `lit_grpo.models.checkpointing`): the same
gradients with it on as off (full and LoRA), the recompute really runs (and only in the training
forward), the auto default resolves as documented, and a 2-process FSDP2 or DDP step with it on has
the gradient of one process without it."""

from __future__ import annotations

import copy

import pytest
import torch
from ddp_grad_probe import assert_ranks_equal_the_union, run_probe

from lit_grpo.config import ConfigError, LoraConfig, ModelConfig
from lit_grpo.loop.micro_batches import no_grad_logprobs, plan_forwards
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.models.checkpointing import (
    AUTO_MIN_HIDDEN_X_LAYERS,
    checkpointed_forward,
    checkpointed_layers,
    checkpointing_wanted,
    enable_gradient_checkpointing,
)
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model
from lit_grpo.models.lora import apply_lora


def _model(num_layers: int = 3, hidden: int = 32, lora_rank: int = 0):
    tokenizer = build_char_tokenizer("arithmetic")
    cfg = ModelConfig(hidden_size=hidden, num_layers=num_layers, num_heads=2, intermediate_size=64)
    model = build_tiny_model(cfg, len(tokenizer), seed=0, tokenizer=tokenizer).eval()  # eval: as GRPOModule keeps it
    if not lora_rank:
        return model
    model = apply_lora(model, LoraConfig(rank=lora_rank), seed=0).eval()
    with torch.no_grad():  # B starts at zero, which would leave A without a gradient to compare
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(8, vocab, (3, 10), generator=g)
    attention_BT = torch.ones_like(tokens_BT)
    attention_BT[1, 7:] = 0  # a shorter row: padding inside the checkpointed layers too
    return tokens_BT, attention_BT


class RecomputeCounter:
    """Counts the decoder layers' forwards that run inside a backward (the checkpoint's recomputes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        classes = type(model.get_base_model() if hasattr(model, "get_base_model") else model)._no_split_modules
        for layer in (m for m in model.modules() if type(m).__name__ in classes):
            layer.register_forward_pre_hook(self._seen)

    def _seen(self, module, args) -> None:
        self.count += int(torch._C._current_graph_task_id() != -1)


def _gradients(model, tokens_BT, attention_BT, layers) -> dict[str, torch.Tensor]:
    with checkpointed_forward(layers):
        logprobs_BT, _ = token_logprobs(model, tokens_BT, attention_BT, temperature=0.7)
    (logprobs_BT * attention_BT[:, 1:]).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_gradients_with_checkpointing_equal_those_without(lora_rank):
    plain = _model(lora_rank=lora_rank)
    checkpointed = copy.deepcopy(plain)
    layers = checkpointed_layers(enable_gradient_checkpointing(checkpointed))
    assert len(layers) == 3
    tokens_BT, attention_BT = _batch(plain.get_input_embeddings().num_embeddings)
    recomputes = RecomputeCounter(checkpointed)

    expected = _gradients(plain, tokens_BT, attention_BT, [])
    got = _gradients(checkpointed, tokens_BT, attention_BT, layers)

    assert recomputes.count == 3, "each checkpointed layer runs its forward again in the backward"
    assert expected.keys() == got.keys() and (any(".lora_" in name for name in got) == bool(lora_rank))
    for name, grad in expected.items():
        assert grad.abs().max() > 0, f"{name} got no gradient"
        diff = (got[name] - grad).abs().max().item()
        assert diff <= 1e-6, f"{name} differs by {diff}"
    # The gate is open only inside `checkpointed_forward`, on the layer objects, never their submodules.
    assert not any(m.training for m in checkpointed.modules())


def test_only_the_training_forward_recomputes():
    model = enable_gradient_checkpointing(_model())
    layers = checkpointed_layers(model)
    tokens_BT, attention_BT = _batch(model.get_input_embeddings().num_embeddings)
    recomputes = RecomputeCounter(model)
    opened = []
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(lambda m, args, kwargs: opened.append(m.training), with_kwargs=True)

    # The reference and old-policy forwards: no gradient, gate closed, so no checkpoint at all.
    no_grad_logprobs(model, tokens_BT, attention_BT, 1.0, plan_forwards(attention_BT, [slice(0, 3)], 3, 0).no_grad)
    # A forward with gradient outside `checkpointed_forward` (e.g. a scoring call) keeps every activation.
    token_logprobs(model, tokens_BT, attention_BT, 1.0)[0].sum().backward()
    assert recomputes.count == 0
    _gradients(model, tokens_BT, attention_BT, layers)
    assert recomputes.count == 3
    assert opened and not any(opened), "attention (and its dropout) ran in training mode"


def test_the_sampler_generates_with_its_kv_cache_under_checkpointing():
    model = enable_gradient_checkpointing(_model())
    prompt = torch.tensor([[10, 11, 12]])
    calls: list[int] = []  # the tokens the first layer sees per call: the prompt, then one at a time
    model.model.layers[0].register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[1]))
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert calls == [3, 1, 1, 1], "generate ran without its KV cache"


def test_the_auto_default_resolves_by_hidden_size_times_layers():
    tiny = _model(num_layers=2, hidden=64)  # the CPU demo's shape
    assert checkpointing_wanted(None, tiny) is False
    assert checkpointing_wanted(True, tiny) is True
    tiny.config.hidden_size, tiny.config.num_hidden_layers = 896, 24  # Qwen2.5-0.5B's shape
    assert checkpointing_wanted(None, tiny) is True
    assert checkpointing_wanted(False, tiny) is False
    tiny.config.hidden_size, tiny.config.num_hidden_layers = AUTO_MIN_HIDDEN_X_LAYERS // 16, 16
    assert checkpointing_wanted(None, tiny) is True
    tiny.config.num_hidden_layers = 15
    assert checkpointing_wanted(None, apply_lora(tiny, LoraConfig(rank=2), seed=0)) is False
    assert 512 * 4 < AUTO_MIN_HIDDEN_X_LAYERS  # the memory measurement's cut stays off unless asked


def test_the_setting_must_be_a_bool_or_null():
    assert ModelConfig(gradient_checkpointing=None).gradient_checkpointing is None
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        ModelConfig(gradient_checkpointing="yes")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_2_process_checkpointed_step_has_the_gradient_of_one_process_without_it(tmp_path, strategy):
    run_probe(tmp_path, 1, "4,6", strategy, "0.01", "grads", "model.gradient_checkpointing=false")
    run_probe(tmp_path, 2, "4,6", strategy, "0.01", "grads", "model.gradient_checkpointing=true")
    assert_ranks_equal_the_union(tmp_path, strategy)
    assert torch.load(tmp_path / f"recomputes_{strategy}_world1_rank0.pt") == 0
    for rank in (0, 1):  # 2 layers, 3 steps of at least 1 micro-batch each: the (sharded) layers recomputed
        assert torch.load(tmp_path / f"recomputes_{strategy}_world2_rank{rank}.pt") >= 2 * 3
