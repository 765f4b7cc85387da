"""A row's images, for a vision-language policy: where they are in the row, loaded offline, and
the prompt its processor makes of them.

A row's chat messages place their images as content items, in transformers' chat format:
`{"type": "image", "image": <the image>}` (or `"path"`, or `"url"`); or as bare `{"type": "image"}`
items whose images are the row's `images` field (a list, or `image`: one), in order. An image is
a `PIL.Image`, a file path, bytes of an encoded image, or a `datasets` Image value (`{"bytes",
"path"}`). A URL is refused: runs are offline. The processor's chat template puts each image's
placeholder tokens in the prompt (`vision_prompt`).

A row whose images cannot be used (missing, unreadable, a URL, as many placeholders as images
not given) raises `RowImageError`: the rollout's sample is dropped and counted as
`rollout/dropped_bad_image`, with one line naming the row.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lit_grpo.types import PromptImages

IMAGE_FIELDS = ("images", "image")
"""Row fields holding the images of bare `{"type": "image"}` items, in order."""
_TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


class RowImageError(ValueError):
    """A row's image that cannot be used; the message says which and why (the sample is dropped,
    and the row is named once: its data is bad, whatever the policy does)."""


class PlaceholderInCompletion(ValueError):
    """A vision-language policy sampled an image placeholder token: it stands for no image, so the
    forward would refuse the sequence. The policy's own mistake, not the row's (the sample is dropped)."""


def image_placeholder_ids(processor: Any) -> frozenset[int]:
    """The processor's image and video placeholder token ids (none for a text policy's None)."""
    ids = (getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None))
    return frozenset(int(i) for i in ids if i is not None)


def load_image(value: Any):
    """`value` as an RGB `PIL.Image`: an image, a file path, encoded bytes, or a `datasets` Image
    value (`{"bytes": ..., "path": ...}`); `RowImageError` for a URL or anything unreadable."""
    from PIL import Image

    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise RowImageError(f"an image dict without bytes or path: keys {sorted(value)}")
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray)):
        source: Any = io.BytesIO(value)
        where = f"{len(value)} bytes"
    elif isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.startswith(("http://", "https://", "ftp://")):
            raise RowImageError(f"image {text!r} is a URL: runs are offline; download it and give its path")
        source, where = text, repr(text)
    else:
        kind = type(value).__name__
        raise RowImageError(f"an image must be a PIL image, a path, bytes or a datasets Image, got {kind}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise RowImageError(f"image {where} not found") from None
    except Exception as err:  # PIL's UnidentifiedImageError, truncated files, ...
        raise RowImageError(f"image {where} cannot be read: {err}") from None


def _image_items(messages: Sequence) -> list[dict]:
    return [
        item
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for item in m["content"]
        if isinstance(item, dict) and item.get("type") == "image"
    ]


def messages_have_images(messages: Sequence) -> bool:
    """Whether chat messages hold an image content item (`{"type": "image", ...}`)."""
    return bool(_image_items(messages))


def row_has_images(row: dict, messages: Optional[list] = None) -> bool:
    """Whether the row's messages hold an image item or the row an `images`/`image` field."""
    messages = messages if messages is not None else row.get("messages")
    return any(row.get(f) is not None for f in IMAGE_FIELDS) or (
        isinstance(messages, list) and bool(_image_items(messages))
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def row_images(row: dict, messages: list[dict]) -> list:
    """The images of the row's image items, in order, loaded (`load_image`); the items' own values
    first, bare items take the row's `images` (or `image`) in order. `RowImageError` when the
    counts of bare items and of the row's images differ."""
    items = _image_items(messages)
    field = next((f for f in IMAGE_FIELDS if row.get(f) is not None), None)
    given = [] if field is None else (row[field] if isinstance(row[field], (list, tuple)) else [row[field]])
    bare = [item for item in items if not any(item.get(k) is not None for k in ("image", "path", "url"))]
    if len(bare) != len(given):
        raise RowImageError(
            f"{_count(len(bare), 'image placeholder')} in the messages for {_count(len(given), 'image')} in the "
            f"row's {field or 'images'} field"
        )
    queue, bare_ids = iter(given), {id(item) for item in bare}
    values = [
        next(queue)
        if id(item) in bare_ids
        else item.get("image")
        if item.get("image") is not None
        else item.get("path") or item.get("url")
        for item in items
    ]
    return [load_image(v) for v in values]


def vision_prompt(processor: Any, messages: list[dict], images: list) -> tuple[list[int], Optional[PromptImages]]:
    """The prompt's token ids (the processor's chat template, generation cue added, each image's
    placeholder expanded to its image tokens) and its images (`PromptImages`: the processor's
    tensors besides the text ones, Qwen2-VL's `pixel_values`, `image_grid_thw`; the images; the
    template's tokens before the expansion); None without images. `RowImageError` when the
    processor refuses them (placeholders and images that do not match)."""
    bare = [
        {**m, "content": [{"type": "image"} if c.get("type") == "image" else c for c in m["content"]]}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]
    text = processor.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
    try:
        out = processor(text=[text], images=images or None, return_tensors="pt")
    except (ValueError, IndexError, StopIteration) as err:
        raise RowImageError(f"the processor refused the prompt's {len(images)} images: {err}") from None
    tokens = out["input_ids"][0].tolist()
    tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS and isinstance(v, torch.Tensor)}
    if not tensors:
        return tokens, None
    template_tokens = processor.tokenizer(text)["input_ids"]  # as the processor tokenizes, before expanding
    return tokens, PromptImages(tensors, images, template_tokens, len(tokens))
