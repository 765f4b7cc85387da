"""The `--ragged` option of benchmarks/vs_trl/rehearsal.py (lit_grpo vs TRL on the CPU rehearsal): the seeded
length stream, the eos-forcing processor, and the wrapped `generate` on lit_grpo's own sampler. Fast,
no TRL, the tiny model."""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers.generation.utils import GenerationMixin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not in the installed package
from benchmarks.vs_trl.rehearsal import RaggedLengths, Settings, install_ragged_lengths, ragged_lengths  # noqa: E402
from lit_grpo.samplers.hf import HFSampler  # noqa: E402


def test_ragged_lengths_are_seeded_and_uniform_in_a_quarter_to_the_whole():
    draws = list(itertools.islice(ragged_lengths(seed=0, max_tokens=256), 2000))
    assert draws == list(itertools.islice(ragged_lengths(seed=0, max_tokens=256), 2000))
    assert draws != list(itertools.islice(ragged_lengths(seed=1, max_tokens=256), 2000))
    assert min(draws) == math.ceil(256 / 4) and max(draws) == 256  # both ends reached
    assert abs(sum(draws) / len(draws) - (64 + 256) / 2) < 5


def test_the_processor_forces_eos_at_each_rows_length_without_writing_the_scores():
    forced = RaggedLengths([1, 3], eos_id=7)  # row 0: eos is its 1st token, row 1: its 3rd
    scores_NV = torch.randn(2, 10)
    before = scores_NV.clone()
    step = [forced(torch.zeros(2, width, dtype=torch.long), scores_NV) for width in (4, 5, 6, 7)]  # prompts: 4
    assert torch.equal(scores_NV, before)  # a new tensor: the recorder's reference keeps the raw scores
    assert step[0][0].argmax() == 7 and torch.isinf(step[0][0]).sum() == 9 and torch.equal(step[0][1], before[1])
    assert torch.equal(step[1], before) and torch.equal(step[3], before)
    assert step[2][1].argmax() == 7 and torch.isinf(step[2][1]).sum() == 9 and torch.equal(step[2][0], before[0])


def test_lit_grpos_sampler_ends_each_completion_at_the_streams_length(tiny_model, tokenizer, monkeypatch):
    monkeypatch.setattr(GenerationMixin, "generate", GenerationMixin.generate)  # undone after the test
    install_ragged_lengths(Settings(seed=3, tokens=12))
    expected = list(itertools.islice(ragged_lengths(seed=3, max_tokens=12), 3))
    sampler = HFSampler(tiny_model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "3+44=", "5="]]

    async def run():
        return await asyncio.gather(
            *(sampler.sample_with_prompt_tokens(p, n=1, temperature=1.0, max_tokens=12) for p in prompts)
        )

    completions = [c for group in asyncio.run(run()) for c in group]
    assert any(len(c.full_tokens) - c.prompt_len == length for c, length in zip(completions, expected))
    for c, length in zip(completions, expected):
        tokens = c.full_tokens[c.prompt_len :]
        # the forced eos ends the row at its length, unless the model drew eos earlier on its own
        assert len(tokens) <= length and tokens[-1] == tokenizer.eos_token_id
        # the recorder scored the raw logits, not the forced ones (logprob 0)
        assert c.sampling_logprobs[-1] < 0


def test_a_trl_arg_replaces_a_field_the_benchmark_sets(tmp_path):
    pytest.importorskip("trl")
    from benchmarks.vs_trl.rehearsal_trl import grpo_config

    assert grpo_config(Settings(), tmp_path).gradient_checkpointing is False
    assert grpo_config(Settings(trl_args={"gradient_checkpointing": True}), tmp_path).gradient_checkpointing is True
