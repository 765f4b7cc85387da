"""Tokenizer and model loading: the tiny model offline, a local HF folder, and a clear error otherwise."""

import pytest
from conftest import compose_config

from lit_grpo.config import ModelConfig
from lit_grpo.models.load import build_char_tokenizer, load_policy, load_tokenizer, save_pretrained
from lit_grpo.train import train


def test_char_tokenizer_round_trips_and_has_a_chat_template():
    tok = build_char_tokenizer("printable")
    text = "12+30=42, Hello!\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>1+1=<|end|><|assistant|>"
    assert tok.decode([tok.eos_token_id, ids[0]], skip_special_tokens=True) == "1"


def test_tiny_model_is_seeded(tokenizer):
    a = load_policy(ModelConfig(), tokenizer, seed=3)
    b = load_policy(ModelConfig(), tokenizer, seed=3)
    c = load_policy(ModelConfig(), tokenizer, seed=4)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert pa.equal(pb) and not pa.equal(pc)


def test_model_hf_loads_a_local_folder_and_trains(tmp_path, tiny_model, tokenizer):
    save_pretrained(tiny_model, tokenizer, tmp_path / "model")
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "model=hf",
            f"model.name_or_path={tmp_path / 'model'}",
            "model.dtype=float32",
            "trainer.fast_dev_run=true",
            output_dir=tmp_path / "run",
        )
    )
    assert summary["steps"] == 1


def test_unreachable_model_names_it_and_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable when first imported (earlier tests did): set its constant too,
    # or the load spends ~45 s retrying the network.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"no-such-org/no-such-model(.|\n)*model\.name_or_path=/path"):
        load_tokenizer(ModelConfig(kind="hf", name_or_path="no-such-org/no-such-model"))
