"""An exported tiny model folder round-trips its tokenizer: `AutoTokenizer.from_pretrained(folder)`
tokenizes, decodes and applies the chat template exactly as the training tokenizer did, the model
gives the same logits, and `model.kind=hf` pointed at the folder loads the same tokenizer.

transformers 5 reloads every Qwen2 folder as `Qwen2Tokenizer` (its own byte-level pre-tokenizer and
decoder over the saved vocabulary), whatever `tokenizer_class` the folder names; a plain character
vocabulary reloaded that way lost every space and newline.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo.config import ModelConfig
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model, load_policy, load_tokenizer
from lit_grpo.run.export import export_pretrained
from lit_grpo.train import train

TEXTS = [
    "a b",
    "3+4=7\n",
    "  two  spaces,\nthen a newline\n\n",
    "Hello, World! (x*y) - {z}/[w]; \"quoted\" 'single' ~`^_|\\@#$%&<>?",
    "1234567890 abcxyz ABCXYZ",
    "<|user|>inline special tokens<|end|><|assistant|>",
    "héllo\tünïcode",  # outside the alphabet: dropped by both, the same way
]
MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 12 + 30?\nAnswer with digits."},
]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_ids(tokenizer) -> list[int]:
    out = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny policy (printable alphabet) and its tokenizer, exported as the end-of-fit callback does."""
    tokenizer = build_char_tokenizer("printable")
    policy = build_tiny_model(ModelConfig(), len(tokenizer), seed=0, tokenizer=tokenizer)
    folder = export_pretrained(policy, tokenizer, tmp_path_factory.mktemp("export") / "final_model")
    return policy, tokenizer, folder


def assert_same_tokenizer(trained, loaded) -> None:
    """Same ids, decodes, chat template and special tokens as the training tokenizer."""
    for text in TEXTS:
        assert ids(loaded, text) == ids(trained, text), text
        assert loaded.decode(ids(loaded, text)) == trained.decode(ids(trained, text)), text
    assert trained.decode(ids(trained, "a b\n3+4=")) == "a b\n3+4="  # what is in the alphabet comes back whole
    assert chat_ids(loaded) == chat_ids(trained)
    assert loaded.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    ) == trained.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert loaded.decode(chat_ids(loaded), skip_special_tokens=True) == trained.decode(
        chat_ids(trained), skip_special_tokens=True
    )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(trained, name), name
    assert loaded.all_special_tokens == trained.all_special_tokens and len(loaded) == len(trained)


@pytest.mark.timeout(300)
def test_auto_tokenizer_reloads_the_training_tokenizer(exported):
    _, trained, folder = exported
    assert_same_tokenizer(trained, AutoTokenizer.from_pretrained(folder))


@pytest.mark.timeout(300)
def test_auto_model_gives_the_policys_logits_on_a_chat_prompt(exported):
    policy, trained, folder = exported
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    tokens = torch.tensor([chat_ids(tokenizer) + ids(tokenizer, "42 ")])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=tokens).logits, policy(input_ids=tokens).logits, atol=1e-5, rtol=1e-5
        )


@pytest.mark.timeout(300)
def test_model_kind_hf_loads_the_folder_with_its_chat_template_and_special_tokens(exported):
    policy, trained, folder = exported
    cfg = ModelConfig(kind="hf", name_or_path=str(folder), dtype="float32")
    tokenizer = load_tokenizer(cfg)
    assert_same_tokenizer(trained, tokenizer)
    assert tokenizer.chat_template == trained.chat_template
    for token in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert ids(tokenizer, token) == ids(trained, token) and len(ids(tokenizer, token)) == 1, token
    loaded = load_policy(cfg, tokenizer, seed=0)
    tokens = torch.tensor([chat_ids(tokenizer)])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=tokens).logits, policy(input_ids=tokens).logits, atol=1e-5, rtol=1e-5
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_training_runs_final_model_reloads_its_tokenizer(tmp_path):
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "model.alphabet=printable",
            "max_steps=1",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 1
    folder = tmp_path / "final_model"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    assert_same_tokenizer(build_char_tokenizer("printable"), AutoTokenizer.from_pretrained(folder))
