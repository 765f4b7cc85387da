"""Forwards of a vision-language policy: the token ids plus the prompt's images.

A transformers VLM (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`, ...)
is `model` (the vision tower, the projector and the language model: it takes `pixel_values` and
puts the image features in place of the image placeholder tokens) plus `lm_head`. Its
`get_decoder()` is the language model alone, which would read the placeholders as plain tokens:
the text path's fused head (`split_lm_head`) must never be used with images. Here the body is the
whole `model`, called with the images, and the head is applied by `head_logprobs_and_entropy` as for
a text policy.

`vision` is what the processor made for the rows' images, each tensor concatenated along dim 0
over the rows in row order (`RolloutBatch.multi_modal.select`): for Qwen2-VL `pixel_values`
`[patches, C·t·p·p]` and `image_grid_thw` `[images, 3]`. `mm_token_type_ids` (text 0, image 1,
video 2; Qwen2-VL's M-RoPE needs it) is derived here from the token ids, so a completion's tokens
need no parallel list. Padded batches only: a packed row's restarting position ids cannot carry
M-RoPE's three position axes.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from lit_grpo.maths.head_logprobs import LMHeadSplit

VisionInputs = dict[str, torch.Tensor]
"""Keyword tensors of the model's forward for the rows' images (`pixel_values`, `image_grid_thw`, ...)."""


def _base(model: Any) -> Any:
    return get_base() if (get_base := getattr(model, "get_base_model", None)) else model


def _forward_takes(module: Any, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def vision_forward_kwargs(model: Any, tokens_BT: torch.Tensor, vision: VisionInputs) -> dict[str, torch.Tensor]:
    """`vision` plus `mm_token_type_ids` `[B, T]` (0 text, 1 `config.image_token_id`, 2
    `config.video_token_id`) when the model's forward takes it and `vision` has none."""
    kwargs = dict(vision)
    base = _base(model)
    if "mm_token_type_ids" not in kwargs and _forward_takes(base, "mm_token_type_ids"):
        config = base.config
        types_BT = torch.zeros_like(tokens_BT, dtype=torch.int32)
        for name, kind in (("image_token_id", 1), ("video_token_id", 2)):
            if (token_id := getattr(config, name, None)) is not None:
                types_BT = types_BT.masked_fill(tokens_BT == token_id, kind)
        kwargs["mm_token_type_ids"] = types_BT
    return kwargs


def split_vlm_head(model: Any, forward_kwargs: dict[str, torch.Tensor]) -> tuple[Optional[LMHeadSplit], str]:
    """The VLM as body (its `model`, called with `forward_kwargs`: the images) + LM head, or
    `(None, why not)`. Not split: a wrapper that answers for its own text split (LoRA's
    adapter-free view, whose body must run with the adapters off: its own forward is used), a
    head that is not a plain `nn.Linear`, a model without a `model` that takes `pixel_values`."""
    if getattr(model, "lm_head_split", None) is not None:
        return None, "a wrapper with its own forward (LoRA's adapter-free view)"
    base = _base(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return None, f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
    if type(head.weight).__name__ == "DTensor":
        return None, "its LM head is sharded (a DTensor)"
    body_module = getattr(base, "model", None)
    if not isinstance(body_module, torch.nn.Module) or not _forward_takes(body_module, "pixel_values"):
        return None, "it has no `model` whose forward takes pixel_values"

    def body(
        input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return body_module(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **forward_kwargs
        ).last_hidden_state

    return LMHeadSplit(body, head), ""
