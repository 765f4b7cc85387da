"""Vision-language model families through `model.kind=hf`: a folder of Qwen2-VL, Qwen2.5-VL or
Idefics3 (SmolVLM's), each a tiny random-init model saved with its processor, loads with its
processor; the trainer's logprobs with images equal transformers' own forward, fused head or not;
the `hf` sampler's logprobs equal the trainer's on what it sampled."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image

from lit_grpo.config import ModelConfig
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.models.load import load_policy, load_processor, load_tokenizer, save_pretrained
from lit_grpo.models.vision import _image_only_processor_class, build_tiny_vlm, build_tiny_vlm_processor
from lit_grpo.tasks.images import vision_prompt
from lit_grpo.types import MultiModalBatch

pytestmark = pytest.mark.timeout(180)
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "idefics3"]
MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}


def _tiny_qwen2_5_vl(tmp_path):
    """A random-init Qwen2.5-VL (window attention in a two-block tower, one block full) with the
    Qwen2-VL tokenizer and image processor, which Qwen2.5-VL shares."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    qwen2 = build_tiny_vlm_processor()
    tokenizer, ids = qwen2.tokenizer, qwen2.tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    processor = _image_only_processor_class(Qwen2_5_VLProcessor)(
        image_processor=qwen2.image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return save_pretrained(model, processor, tmp_path)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, policy, processor) loaded as `model.kind=hf` from a folder of the family's tiny model."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2_5_vl":
        _tiny_qwen2_5_vl(folder)
    else:
        processor = build_tiny_vlm_processor(arch=request.param)
        save_pretrained(build_tiny_vlm(processor.tokenizer, seed=0, arch=request.param), processor, folder)
    cfg = ModelConfig(kind="hf", name_or_path=str(folder))
    tokenizer = load_tokenizer(cfg)
    return request.param, load_policy(cfg, tokenizer, seed=0).eval(), load_processor(cfg, tokenizer)


def trainer_logprobs_of(model, completions, temperature, pad_id, with_images=True):
    """The trainer's forward over the completions, right-padded as its batch, with each row's images."""
    width = max(len(c.full_tokens) for c, _ in completions)
    tokens = torch.full((len(completions), width), pad_id)
    attention = torch.zeros_like(tokens)
    for i, (c, _) in enumerate(completions):
        tokens[i, : len(c.full_tokens)] = torch.tensor(c.full_tokens)
        attention[i, : len(c.full_tokens)] = 1
    images = MultiModalBatch.of([dict(im) if im else None for _, im in completions])  # None: a text row
    assert images is not None
    vision = images.select(slice(0, len(completions))) if with_images else None
    with torch.no_grad():
        return token_logprobs(model, tokens, attention, temperature, vision=vision)[0]


def _prompt(processor, image, text="which colour is it?"):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return vision_prompt(processor, messages, [image])


def test_the_family_loads_as_its_class_with_its_tower_frozen(family):
    name, policy, processor = family
    assert type(policy).__name__ == MODEL_CLASSES[name]
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
    assert frozen and all(("visual" in n or "vision_model" in n) for n in frozen), frozen[:3]
    assert processor is not None and processor.image_token_id is not None


@pytest.mark.parametrize("fused_head", [True, False])
def test_trainer_logprobs_with_images_equal_transformers_forward(family, fused_head):
    name, policy, processor = family
    tokens, images = _prompt(processor, Image.new("RGB", (56, 56), (0, 180, 30)))
    ids = torch.tensor([tokens + [20, 21, 22]])
    # As the processor gives them to transformers: Qwen2's M-RoPE reads which tokens are the image's.
    types = {"mm_token_type_ids": (ids == processor.image_token_id).int()} if name.startswith("qwen") else {}
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids), **images, **types).logits.float() / 0.7
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        ours, _ = token_logprobs(policy, ids, torch.ones_like(ids), 0.7, fused_head=fused_head, vision=dict(images))
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-5)
    with torch.no_grad():  # the images are in: without them the same tokens score otherwise
        blind, _ = token_logprobs(policy, ids, torch.ones_like(ids), 0.7, fused_head=fused_head)
    assert (blind - ours).abs().max() > 1e-3


def test_hf_sampler_logprobs_with_images_equal_the_trainer_forward(family):
    from lit_grpo.samplers.hf import HFSampler

    _, policy, processor = family
    prompts = [
        _prompt(processor, Image.new("RGB", (56, 56), (220, 20, 20))),
        _prompt(processor, Image.new("RGB", (28, 56), (20, 20, 220)), "colour?"),
    ]
    sampler = HFSampler(policy, processor.tokenizer)
    torch.manual_seed(0)  # draws with no image placeholder token (a rollout would drop such a sample)

    async def sample_both():
        return await asyncio.gather(
            *(
                sampler.sample_with_prompt_tokens(t, n=2, temperature=0.9, max_tokens=5, multi_modal=im)
                for t, im in prompts
            )
        )

    try:
        groups = asyncio.run(sample_both())
    finally:
        sampler.close()
    completions = [(c, im) for group, (_, im) in zip(groups, prompts) for c in group]
    trainer = trainer_logprobs_of(policy, completions, 0.9, processor.tokenizer.pad_token_id)
    for i, (c, _) in enumerate(completions):
        generated = len(c.full_tokens) - c.prompt_len
        got = trainer[i, c.prompt_len - 1 : c.prompt_len - 1 + generated]
        torch.testing.assert_close(got, torch.tensor(c.sampling_logprobs), atol=2e-5, rtol=1e-5)
