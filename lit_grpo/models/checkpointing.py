"""Gradient checkpointing of the policy's decoder layers (`model.gradient_checkpointing`).

Each decoder layer keeps only its input for the backward and recomputes its activations there,
through transformers' own `gradient_checkpointing_enable` with non-reentrant
`torch.utils.checkpoint` (the kind that needs no input with `requires_grad`, so frozen LoRA base
weights and embeddings need no workaround, and that composes with FSDP2: a layer's recompute runs
inside its unit's pre-backward all-gather).

Transformers checkpoints a layer only while that layer is in training mode, and lit_grpo keeps the
whole policy in eval mode (no dropout, so the trainer's logprobs match the sampler's). So the
layers are switched on only for the length of the training forward (`checkpointed_forward`): the
layer objects' own flag alone, never their submodules' (their attention and MLP, which hold the
dropout, stay in eval mode). Everything else the policy runs (the old-policy forward, the HF
sampler's `generate` on shared weights, a deep copy made for the reference or a sampler) keeps the
gate closed and pays nothing for it.

The default (null) turns it on for models whose activations dominate a step's memory:
`hidden_size × num_layers ≥ AUTO_MIN_HIDDEN_X_LAYERS`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

from torch import nn

from lit_grpo.config import ConfigError

AUTO_MIN_HIDDEN_X_LAYERS = 16_384
"""`model.gradient_checkpointing: null` turns it on from this `hidden_size × num_layers` up (e.g. 1024 × 16).

Without it, a step's activations are about 110 bytes per token and per unit of `hidden × layers`
in float32 (measured: 896 MB for 4 × 512 over 8 × 512 tokens, 280 MB with it on; docs/results.md),
so 1.8 MB per token here: 7 GB for a micro-batch of 4,096 tokens, where the weights, gradients and
Adam state of a model of this shape (1024 × 16, about 200M parameters at 16 bytes each) are about
3 GB. Past it the activations outgrow the model, and checkpointing (one more forward per layer,
about a third more compute) keeps a layer's input alone. Real models start above it (Qwen2.5-0.5B:
896 × 24 = 21,504; SmolLM2-135M: 576 × 30); the CPU demo's tiny model (64 × 2) and the 4-layer cuts
of tests and benchmarks stay below, so their speed is unchanged.
"""


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (`model` itself when there is none)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def hidden_x_layers(model: nn.Module) -> int:
    """`hidden_size × num_hidden_layers` of a transformers model's config (0 when it names neither)."""
    config = getattr(base_model(model), "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()  # a vision-language model's text half
    hidden = getattr(text_config, "hidden_size", 0) or 0
    layers = getattr(text_config, "num_hidden_layers", 0) or 0
    return int(hidden) * int(layers)


def checkpointing_wanted(setting: Optional[bool], model: nn.Module) -> bool:
    """`model.gradient_checkpointing` resolved: true / false as set; null (auto) on from
    `AUTO_MIN_HIDDEN_X_LAYERS` up, and only for a model whose layers transformers can checkpoint."""
    if setting is not None:
        return setting
    supported = bool(getattr(base_model(model), "supports_gradient_checkpointing", False))
    return supported and hidden_x_layers(model) >= AUTO_MIN_HIDDEN_X_LAYERS


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers transformers checkpoints (`GradientCheckpointingLayer`s with the flag on)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Turn on non-reentrant checkpointing of every decoder layer of `model` (in place; a peft
    model's base model). Call it before FSDP2 shards the layers. Returns `model`.

    Raises `ConfigError` naming `model.gradient_checkpointing` when the model cannot be checkpointed
    by layer (no transformers `GradientCheckpointingLayer`, e.g. older remote code)."""
    base: Any = base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"config field `model.gradient_checkpointing`: {type(base).__name__} does not support "
            "gradient checkpointing; set it to false"
        )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not checkpointed_layers(base):
        base.gradient_checkpointing_disable()
        raise ConfigError(
            f"config field `model.gradient_checkpointing`: {type(base).__name__}'s decoder layers are not "
            "transformers GradientCheckpointingLayers, so lit_grpo cannot checkpoint them in eval mode; set it to false"
        )
    return model


@contextlib.contextmanager
def checkpointed_forward(layers: list[nn.Module]) -> Iterator[None]:
    """Checkpoint `layers` (`checkpointed_layers(model)`, looked up once) in the forwards run inside
    (no list: a no-op). Opens transformers' gate (`layer.training`) on the layer objects only, not
    recursively, so no dropout turns on; closed again on the way out, whatever happens."""
    layers = [layer for layer in layers if not layer.training]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False
