"""The real-size rehearsal (`model=rehearsal_0p5b`, `+experiment=rehearsal_0p5b`): the model has
Qwen2.5-0.5B's documented shapes, its locally built tokenizer covers all 151,936 ids and reloads
from an exported folder as it was, bad sizes are one message before any model loads, and (slow)
the experiment cut to one layer trains, checkpoints and resumes on CPU at the full vocabulary."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config

from lit_grpo.config import ConfigError, ModelConfig
from lit_grpo.config.model import MIN_BYTE_BPE_VOCAB
from lit_grpo.models.byte_bpe import BYTES, QWEN2_PRETOKENIZE_REGEX, build_byte_bpe_tokenizer, shipped_merges
from lit_grpo.models.load import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_model,
    load_tokenizer,
    qwen2_config,
    save_pretrained,
)
from lit_grpo.run.validate import validate
from lit_grpo.tasks.gsm8k import BUNDLED_FILES
from lit_grpo.train import train

REPO = Path(__file__).resolve().parents[1]
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k_test_sample.jsonl"
VOCAB = 151_936
# Qwen2.5-0.5B's config.json (Qwen/Qwen2.5-0.5B on the Hugging Face hub), the fields that fix its shapes.
QWEN2P5_0P5B = {
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
QWEN2P5_0P5B_ROPE_THETA = 1_000_000.0
FILLER = re.compile(r"<[a-z]{4}>")  # a filler token's text (lit_grpo.models.byte_bpe)


def gsm8k_texts() -> list[str]:
    rows = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]
    return [text for row in rows for text in (row["question"], row["answer"])]


def byte_bpe_tokenizer(vocab_size: int):
    """`model.kind=qwen2_shape`'s tokenizer, through the public loader."""
    return load_tokenizer(ModelConfig(kind="qwen2_shape", vocab_size=vocab_size))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_bpe_tokenizer(VOCAB)


def test_the_model_config_has_qwen2p5_0p5b_shapes(tmp_path):
    c = validate(compose_config("model=rehearsal_0p5b", output_dir=tmp_path))
    tokenizer = load_tokenizer(c.model)
    config = qwen2_config(c.model, len(tokenizer), tokenizer)
    assert {key: getattr(config, key) for key in QWEN2P5_0P5B} == QWEN2P5_0P5B
    assert config.rope_parameters["rope_theta"] == QWEN2P5_0P5B_ROPE_THETA
    with torch.device("meta"):  # the shapes without the 2 GB of weights
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    # Qwen2.5-0.5B's model card: 0.49B parameters, 0.36B of them outside the embedding.
    assert (round(total / 1e9, 2), round((total - embedding) / 1e9, 2)) == (0.49, 0.36)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert (c.model.dtype, c.model.kind) == ("float32", "qwen2_shape")


def test_the_tokenizer_covers_the_vocabulary_and_round_trips_gsm8k(tokenizer):
    assert len(tokenizer) == VOCAB
    texts = tokenizer.batch_decode([[i] for i in range(VOCAB)])
    assert all(texts), [i for i, text in enumerate(texts) if not text][:5]  # every id decodes to some text
    merged = len(SPECIAL_TOKENS) + BYTES + len(shipped_merges())
    assert len(set(tokenizer.convert_ids_to_tokens(list(range(VOCAB))))) == VOCAB  # one token per id
    assert FILLER.fullmatch(texts[-1]) and not FILLER.fullmatch(texts[merged - 1])
    for text in [*gsm8k_texts(), "héllo\tünïcode ✓ 日本", "  two  spaces,\nthen a newline\n\n"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text  # every byte has an id: nothing is dropped
        assert max(ids) < merged  # encoding never makes a filler
    # The learned merges give GSM8K about a real tokenizer's length (Qwen2.5's: about 4 characters a token).
    questions = gsm8k_texts()[::2]
    chars = sum(map(len, questions))
    tokens = sum(len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions)
    assert 3.5 < chars / tokens < 4.5
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>1+1?<|end|><|assistant|>"


def test_a_smaller_vocabulary_keeps_the_first_merges():
    tokenizer = byte_bpe_tokenizer(MIN_BYTE_BPE_VOCAB + 3)
    assert len(tokenizer) == MIN_BYTE_BPE_VOCAB + 3 == len(SPECIAL_TOKENS) + BYTES + 3
    first = ["".join(pair) for pair in shipped_merges()[:3]]
    assert tokenizer.convert_ids_to_tokens(list(range(MIN_BYTE_BPE_VOCAB, MIN_BYTE_BPE_VOCAB + 3))) == first
    assert tokenizer.decode(tokenizer("Natalia sold 48 clips.")["input_ids"]) == "Natalia sold 48 clips."
    with pytest.raises(ValueError, match="vocab_size must be >= 264"):
        build_byte_bpe_tokenizer(MIN_BYTE_BPE_VOCAB - 1, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE)


def test_the_pre_tokenizer_is_qwen2s():
    from transformers.models.qwen2 import tokenization_qwen2

    assert QWEN2_PRETOKENIZE_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_an_exported_folder_reloads_the_same_tokenizer(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    cfg = ModelConfig(
        kind="qwen2_shape", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=VOCAB
    )
    model = build_tiny_model(cfg, len(tokenizer), seed=0, tokenizer=tokenizer)
    reloaded = AutoTokenizer.from_pretrained(save_pretrained(model, tokenizer, tmp_path / "model"))
    assert len(reloaded) == VOCAB
    for text in [*gsm8k_texts()[:10], "héllo\tünïcode", "<|user|>inline specials<|end|>"]:
        assert (
            reloaded(text, add_special_tokens=False)["input_ids"]
            == tokenizer(text, add_special_tokens=False)["input_ids"]
        )
    some_ids = [[i] for i in range(0, VOCAB, 97)]
    assert reloaded.batch_decode(some_ids) == tokenizer.batch_decode(some_ids)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    assert reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.num_layers=0", "model.num_layers"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("model.vocab_size=100", "model.vocab_size"),
        ("model.vocab_size=null", "model.vocab_size"),
        ("model.rope_theta=-1", "model.rope_theta"),
    ],
)
def test_bad_sizes_are_refused_before_a_model_loads(tmp_path, override, field):
    with pytest.raises(ConfigError, match=re.escape(f"`{field}`")):
        validate(compose_config("model=rehearsal_0p5b", override, output_dir=tmp_path))


def test_a_vocab_size_on_the_tiny_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`model.vocab_size`: must be null with model.kind=tiny"):
        validate(compose_config("model.vocab_size=300", output_dir=tmp_path))


def test_the_command_line_names_a_bad_layer_count_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=rehearsal_0p5b", "model.num_layers=0"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's lit_grpo, wherever pytest runs
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "`model.num_layers`: must be > 0, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_the_experiment_composes_with_bundled_rows(tmp_path):
    from lit_grpo.tasks import evaluation_rows, source_problems, training_rows

    c = validate(compose_config("+experiment=rehearsal_0p5b", output_dir=tmp_path))
    assert (c.model.kind, c.model.num_layers, c.model.vocab_size, c.sampler.kind) == ("qwen2_shape", 4, VOCAB, "hf")
    assert (c.sampler.max_completion_tokens, c.offpolicy.weight_sync_interval, c.resume) == (256, 1, "auto")
    assert c.checkpoint.save_interval > 0 and c.callbacks["reward_filter"] is None
    assert source_problems(c) == []
    rows = training_rows(c)
    assert len(rows) == 256 == len(BUNDLED_FILES["train"].read_text().splitlines())
    assert rows[0]["question"].startswith("Natalia sold clips") and "messages" in rows[0]

    held_out = validate(
        compose_config("+experiment=rehearsal_0p5b", "task.eval_path=bundled", "data.eval_rows=64", output_dir=tmp_path)
    )
    assert source_problems(held_out) == []
    test_rows = evaluation_rows(held_out)
    sample = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]  # the first 40 test rows
    assert len(test_rows) == 64 and [r["question"] for r in test_rows[:40]] == [r["question"] for r in sample]


# The experiment at CI size: the real vocabulary and widths, one layer, 2 prompts × G=2, 16 tokens.
CI_RUN = [
    "+experiment=rehearsal_0p5b",
    "model.num_layers=1",
    "data.completions_per_prompt=2",
    "data.prompt_groups_per_step=2",
    "sampler.max_completion_tokens=16",
    "checkpoint.save_interval=2",
    "callbacks.sample_log.every_n_steps=1",  # samples.jsonl: every step's completions
    "trainer.enable_progress_bar=false",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_rehearsal_trains_checkpoints_and_resumes_at_the_real_vocabulary(tmp_path):
    run = tmp_path / "run"
    first = train(compose_config(*CI_RUN, "max_steps=2", "output_model_id=null", output_dir=run))
    assert first["steps"] == 2
    assert (run / "checkpoints" / "step_00000002" / "manifest.json").is_file()

    resumed = train(compose_config(*CI_RUN, "max_steps=3", output_dir=run))  # resume=auto: the same folder
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_00000002") and resumed["steps"] == 3
    assert (run / "checkpoints" / "step_00000003" / "manifest.json").is_file()

    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    # The version each step trained at: a weight sync (and a version) after every step, kept across the resume.
    assert [float(r["policy/version"]) for r in rows] == [0.0, 1.0, 2.0]
    assert all(float(r["perf/weight_sync_s"]) > 0 for r in rows)
    assert all(float(r["train/tokens"]) == 2 * 2 * 16 for r in rows)  # 4 sequences of 16 sampled tokens
    numbers = [float(v) for r in rows for v in r.values() if v not in ("", None)]
    assert numbers and all(math.isfinite(v) for v in numbers)

    # 151,936 ids end to end: the exported model and tokenizer, and completions sampled far past the merges.
    exported = json.loads((run / "final_model" / "config.json").read_text())
    assert (exported["vocab_size"], exported["hidden_size"], exported["num_key_value_heads"]) == (VOCAB, 896, 2)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(FILLER.search(s["completion"]) for s in samples)
