"""The two examples run on CPU, and the multi-turn one really makes multi-turn samples."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_grpo.samplers.hf import HFSampler
from lit_grpo.types import RolloutSetup

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["single_turn_token_in", "multi_turn_message_in"])
def test_example_trains_one_step(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false", f"output_dir={tmp_path}"],
        cwd=EXAMPLES / name, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'steps': 1.0" in proc.stdout
    assert (tmp_path / "summary.json").exists()


def test_multi_turn_rollout_retries_with_masked_user_turns(tiny_model, tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "multi_turn_message_in"))
    for mod in ("rollout", "reward"):
        sys.modules.pop(mod, None)
    import rollout as multi_turn

    setup = RolloutSetup(HFSampler(tiny_model, tokenizer), tokenizer, {"max_tokens": 2, "temperature": 1.0}, {"max_turns": 3})
    rollout_fn = multi_turn.make_rollout_fn(setup)
    # An answer no two-token completion can match: every turn is wrong, so all three are taken.
    sample = asyncio.run(rollout_fn({"prompt": "1+1=", "answer": "123456"}))
    mask = sample.loss_mask
    runs_of_ones = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
    assert runs_of_ones == 3
    assert sample.reward == 0.0
    retry = tokenizer(multi_turn.RETRY_MESSAGE, add_special_tokens=False)["input_ids"]
    text_tokens = sample.tokens
    assert any(text_tokens[i : i + len(retry)] == retry for i in range(len(text_tokens)))
    for m, lp in zip(mask, sample.logprobs):
        assert (lp == 0.0) or m == 1  # only sampled tokens carry sampler logprobs
    for mod in ("rollout", "reward"):
        sys.modules.pop(mod, None)
