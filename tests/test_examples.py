"""The two examples run on CPU, and the multi-turn one really makes multi-turn samples."""

import ast
import asyncio
import json
import math
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
        [
            sys.executable,
            "train.py",
            "trainer.fast_dev_run=true",
            "trainer.enable_progress_bar=false",
            f"output_dir={tmp_path}",
            "~callbacks.reward_filter",
            "callbacks.sample_log.every_n_steps=1",
            "callbacks.sample_log.max_samples=1000",
        ],
        cwd=EXAMPLES / name,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The example prints train()'s summary dict as its last line: parse it, don't grep it.
    printed = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert set(printed) == {"steps", "first_reward", "final_reward", "best_reward", "wall_s"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in printed.values()), printed
    assert printed["steps"] == 1.0
    assert printed["first_reward"] == printed["final_reward"] == printed["best_reward"]  # one step
    assert printed["wall_s"] > 0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert {k: written[k] for k in printed} == printed
    assert written["reward_curve"] == [printed["final_reward"]]
    # No filter, every sample logged: the printed reward is the mean of the step's sample rewards.
    table = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(table) == 64 and {row["step"] for row in table} == {1}  # 8 prompts x 8 completions
    rewards = [row["reward"] for row in table]
    # Exact match; the multi-turn example discounts a right answer by 0.5 per retry (3 turns at most).
    assert set(rewards) <= ({0.0, 1.0} if name == "single_turn_token_in" else {0.0, 1.0, 0.5, 0.25})
    assert sum(rewards) > 0  # seed 0 finds some right answers: the mean below is no constant 0
    assert printed["final_reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)


def test_multi_turn_rollout_retries_with_masked_user_turns(tiny_model, tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "multi_turn_message_in"))
    for mod in ("rollout", "reward"):
        sys.modules.pop(mod, None)
    import rollout as multi_turn

    setup = RolloutSetup(
        HFSampler(tiny_model, tokenizer), tokenizer, {"max_tokens": 2, "temperature": 1.0}, {"max_turns": 3}
    )
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
