"""Vision-language policies: a tiny Qwen2-VL built here (no download) and its processor.

`build_tiny_vlm` makes a random-init `Qwen2VLForConditionalGeneration` (a one-block vision tower,
a two-layer text model) with a character tokenizer that holds the special tokens Qwen2-VL's chat
template and processor need (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`,
`<|vision_end|>`, `<|video_pad|>`), and `build_tiny_vlm_processor` a `Qwen2VLProcessor` whose
image processor resizes into a few patches (a 56 × 56 image: a 1 × 4 × 4 grid of 14-pixel patches,
merged 2 × 2 into 4 `<|image_pad|>` tokens).

The processor is built with the PIL image processor (`Qwen2VLImageProcessorPil`) and no video
processor: transformers 5's video processors need torchvision, which this project does not
install, and its processor class check refuses a missing one (`ImageOnlyProcessor`).
"""

from __future__ import annotations

import string
from typing import Any, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

VLM_SPECIAL_TOKENS = [
    "<|endoftext|>",  # pad
    "<|im_start|>",
    "<|im_end|>",  # eos: the end of the assistant's turn
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
"""Qwen2-VL's special tokens, in id order (the tiny VLM's ids 0..6)."""

VLM_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"

# Qwen2-VL's template, reduced to what a tiny model needs: roles in im_start/im_end turns, an
# image item (`{"type": "image", ...}`) as vision_start + one image_pad + vision_end (the processor
# repeats the pad to the image's token count), text items as they are.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_IMAGE_PIXELS = (28 * 28, 56 * 56)
"""min and max pixels of the tiny processor: an image is resized to 28 × 28 .. 56 × 56 (1 to 4 image tokens)."""


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level, byte-level-shaped tokenizer (as `lit_grpo.models.load.build_char_tokenizer`)
    with Qwen2-VL's special tokens first and its chat template (`VLM_CHAT_TEMPLATE`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(char)[0][0] for char in VLM_ALPHABET]
    vocab = {tok: i for i, tok in enumerate(VLM_SPECIAL_TOKENS + symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=VLM_SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def _image_only_processor_class(base: Optional[type] = None):
    from transformers import Qwen2VLProcessor

    class ImageOnlyProcessor(base or Qwen2VLProcessor):  # type: ignore[misc]
        """`Qwen2VLProcessor` without a video processor (see the module docstring): the class check
        of a `None` video processor is skipped, everything else is transformers' own."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs: Any) -> list[str]:
            """The tokenizer (with the chat template) and the image processor's config
            (`preprocessor_config.json`): what `Qwen2VLProcessor.from_pretrained` reads for images;
            transformers' own save refuses the missing video processor."""
            return [
                *self.tokenizer.save_pretrained(save_directory, **kwargs),
                *self.image_processor.save_pretrained(save_directory, **kwargs),
            ]

    return ImageOnlyProcessor


def build_tiny_vlm_processor(tokenizer: Optional[Any] = None, *, patch_size: int = 14):
    """A Qwen2-VL processor over `tokenizer` (default `build_vlm_tokenizer()`): images resized
    within `TINY_IMAGE_PIXELS`, patches of `patch_size`, merged 2 × 2, two frames a temporal patch."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = tokenizer if tokenizer is not None else build_vlm_tokenizer()
    min_pixels, max_pixels = TINY_IMAGE_PIXELS
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size, merge_size=2, temporal_patch_size=2
    )
    return _image_only_processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def load_image_processor_of(name: str, tokenizer, *, trust_remote_code: bool = False):
    """A model folder's processor: `AutoProcessor`'s, or, where its video processor cannot be built
    (transformers 5's need torchvision), the same processor class with the folder's image processor
    and `tokenizer` and no video processor (`ImageOnlyProcessor`)."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    except ImportError:
        pass
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    base: Any = PROCESSOR_MAPPING[type(config)]
    image_processor = AutoImageProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    return _image_only_processor_class(base)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def tiny_vlm_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, patch_size: int = 14):
    """A `Qwen2VLConfig`: a one-block vision tower (embed dim 32) and a small text model with tied
    embeddings; M-RoPE sections sum to head_dim / 2 (16 / 2 = 8 at 64 wide, 4 heads)."""
    from transformers import Qwen2VLConfig

    heads = 4
    half = hidden_size // heads // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]  # temporal, height, width
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=hidden_size,
            num_heads=2,
            mlp_ratio=2,
            patch_size=patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def build_tiny_vlm(tokenizer, seed: int, **shape: Any) -> PreTrainedModel:
    """A random-init `Qwen2VLForConditionalGeneration` of `tiny_vlm_config(tokenizer, **shape)`,
    initialised by transformers' own init from `seed`, in eval mode (no dropout)."""
    from transformers import Qwen2VLForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(tiny_vlm_config(tokenizer, **shape))
    model.eval()
    return model


def freeze_vision_tower(model: torch.nn.Module, train_vision: bool = False) -> list[str]:
    """Turn off the gradient of the vision tower's parameters (`model.visual`, or `model.model.visual`)
    unless `train_vision`; the names frozen."""
    get_base = getattr(model, "get_base_model", None)  # a peft model: the model under its adapters
    base: Any = get_base() if callable(get_base) else model
    tower = getattr(getattr(base, "model", base), "visual", None) or getattr(base, "visual", None)
    if tower is None or train_vision:
        return []
    names = [name for name, p in tower.named_parameters() if p.requires_grad]
    tower.requires_grad_(False)
    return names
