"""Vision-language policies: tiny ones built here (no download) with their processors, and a
model folder's processor.

Two architectures (`TINY_VLM_ARCHS`, `model.vlm_arch`), each a random-init model with a character
tokenizer holding its family's special tokens and chat template, and its processor:

- `qwen2_vl`: `Qwen2VLForConditionalGeneration` (a one-block vision tower, M-RoPE); a 56 × 56
  image is a 1 × 4 × 4 grid of 14-pixel patches, merged 2 × 2 into 4 `<|image_pad|>` tokens.
- `idefics3` (the SmolVLM family): `Idefics3ForConditionalGeneration` (a SigLIP-like tower, a
  pixel-shuffle connector, a Llama text model); an image, resized to 56 pixels on its longest
  side, is `<fake_token_around_image><global-img>` + 4 `<image>` tokens + `<fake_token_around_image>`.
  vLLM 0.32's CPU build runs this one without torchvision (its Qwen2-VL needs it), so the vLLM
  samplers' tests use it; its attention heads are 32 wide (the CPU attention's smallest).

The processor is built with the PIL image processor (`Qwen2VLImageProcessorPil`) and no video
processor: transformers 5's video processors need torchvision, which this project does not
install, and its processor class check refuses a missing one (`ImageOnlyProcessor`).
"""

from __future__ import annotations

import string
from typing import Any, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from lit_grpo.config.model import TINY_VLM_ARCHS

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


IDEFICS3_SPECIAL_TOKENS = [
    "<|endoftext|>",  # pad
    "<end_of_utterance>",  # eos: the end of a turn
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
]
"""Idefics3's special tokens, in id order (the tiny Idefics3's ids 0..4)."""

# Idefics3's (SmolVLM's) turn format: "User:" ... "<end_of_utterance>\n", an image item as one
# `<image>` (the processor expands it), the generation cue "Assistant:".
IDEFICS3_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

_SPECIALS = {
    "qwen2_vl": (VLM_SPECIAL_TOKENS, VLM_CHAT_TEMPLATE),
    "idefics3": (IDEFICS3_SPECIAL_TOKENS, IDEFICS3_CHAT_TEMPLATE),
}
assert set(_SPECIALS) == set(TINY_VLM_ARCHS), "every model.vlm_arch has its tokens and template here"


def build_vlm_tokenizer(arch: str = "qwen2_vl") -> PreTrainedTokenizerFast:
    """A character-level, byte-level-shaped tokenizer (as `lit_grpo.models.load.build_char_tokenizer`)
    with `arch`'s special tokens first (pad, then eos, ...) and its chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    specials, template = _SPECIALS[arch]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(char)[0][0] for char in VLM_ALPHABET]
    vocab = {tok: i for i, tok in enumerate(specials + symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=specials[0], eos_token=specials[1], additional_special_tokens=specials[1:]
    )
    tokenizer.chat_template = template
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


TINY_IDEFICS3_IMAGE = 56
"""The tiny Idefics3's image side: an image is resized to it on its longest side (no tiling)."""


def build_tiny_vlm_processor(tokenizer: Optional[Any] = None, *, patch_size: int = 14, arch: str = "qwen2_vl"):
    """`arch`'s processor over `tokenizer` (default `build_vlm_tokenizer(arch)`). Qwen2-VL: images
    resized within `TINY_IMAGE_PIXELS`, patches of `patch_size`, merged 2 × 2, two frames a temporal
    patch. Idefics3: images resized to `TINY_IDEFICS3_IMAGE` on the longest side, not split into
    tiles, 4 `<image>` tokens each ((56 / 14)² patches shuffled 2 × 2)."""
    tokenizer = tokenizer if tokenizer is not None else build_vlm_tokenizer(arch)
    if arch == "idefics3":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        side = {"longest_edge": TINY_IDEFICS3_IMAGE}
        return Idefics3Processor(
            image_processor=Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side),
            tokenizer=tokenizer,
            image_seq_len=(TINY_IDEFICS3_IMAGE // patch_size) ** 2 // 4,
            chat_template=tokenizer.chat_template,
        )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

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


def tiny_vlm_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, patch_size: int = 14):
    """A `Qwen2VLConfig`: a one-block vision tower (embed dim 32) and a small text model with tied
    embeddings; M-RoPE sections sum to head_dim / 2 (16 / 2 = 8 at 64 wide, 4 heads)."""
    from transformers import Qwen2VLConfig

    heads = num_heads
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


def tiny_idefics3_config(
    tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2, patch_size: int = 14
):
    """An `Idefics3Config`: a one-layer vision tower (width 32) over `TINY_IDEFICS3_IMAGE`-pixel
    images, a pixel-shuffle connector (scale 2), and a Llama text model with tied embeddings and
    grouped-query pairs of heads (2 heads of 32 by default: vLLM's CPU attention takes no narrower)."""
    from transformers import Idefics3Config

    heads = num_heads
    return Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=max(heads // 2, 1),
            max_position_embeddings=1024,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=TINY_IDEFICS3_IMAGE,
            patch_size=patch_size,
        ),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def build_tiny_vlm(
    tokenizer, seed: int, *, arch: str = "qwen2_vl", init_std: Optional[float] = None, **shape: Any
) -> PreTrainedModel:
    """A random-init VLM of `arch` (`tiny_vlm_config` or `tiny_idefics3_config` of `tokenizer` and
    `shape`), initialised by transformers' own init from `seed` (the language model's weights with
    std `init_std`, None: transformers' 0.02), in eval mode (no dropout)."""
    from transformers import Idefics3ForConditionalGeneration, Qwen2VLForConditionalGeneration

    config = tiny_idefics3_config(tokenizer, **shape) if arch == "idefics3" else tiny_vlm_config(tokenizer, **shape)
    if init_std is not None:
        config.text_config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model_class = Idefics3ForConditionalGeneration if arch == "idefics3" else Qwen2VLForConditionalGeneration
        model: PreTrainedModel = model_class(config)
    model.eval()
    return model


VISION_TOWER_NAMES = ("visual", "vision_model", "vision_tower")
"""Where transformers' VLMs keep their vision tower, under the model's `model` (Qwen2-VL's
`visual`, Idefics3's `vision_model`, LLaVA's `vision_tower`). What the tower holds is frozen with
it: Qwen2-VL's projector (`merger`) is inside `visual`; Idefics3's (`connector`) and LLaVA's
(`multi_modal_projector`) sit beside their towers and train with the language model."""


def freeze_vision_tower(model: torch.nn.Module, train_vision: bool = False) -> list[str]:
    """Turn off the gradient of the vision tower's parameters (`VISION_TOWER_NAMES`, under the
    model's `model` or the model itself) unless `train_vision`; the names frozen."""
    get_base = getattr(model, "get_base_model", None)  # a peft model: the model under its adapters
    base: Any = get_base() if callable(get_base) else model
    towers = (
        getattr(owner, name, None) for owner in (getattr(base, "model", None), base) for name in VISION_TOWER_NAMES
    )
    tower = next((t for t in towers if isinstance(t, torch.nn.Module)), None)
    if tower is None or train_vision:
        return []
    names = [name for name, p in tower.named_parameters() if p.requires_grad]
    tower.requires_grad_(False)
    return names
