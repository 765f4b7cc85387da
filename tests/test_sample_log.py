"""The sample log: what the policy writes, every N steps, to a JSONL file, TensorBoard and W&B."""

import json
import os

import pytest

from lit_grpo.callbacks.sample_log import markdown, sample_table
from lit_grpo.tasks.rows import prompt_text
from lit_grpo.train import compose_config, train
from lit_grpo.types import PromptGroup, RolloutSample


def test_sample_table_pairs_each_sequence_with_its_advantage(tokenizer):
    def sample(text, reward):
        return RolloutSample([10, 11, 12], [0.0, -1.0, -1.0], [0, 1, 1], reward, finish_reason="length", text=text)

    groups = [
        PromptGroup(row={"prompt": "1+1="}, samples=[sample("2", 1.0), sample("3", 0.0)], version=3),
        PromptGroup(row={"messages": [{"role": "user", "content": "hi"}]}, samples=[sample("", 0.5)], version=4),
    ]
    table = sample_table(groups, [0.7, -0.7, 0.0], step=5, tokenizer=tokenizer, limit=10)
    assert [(r["prompt"], r["completion"], r["reward"], r["advantage"], r["version"]) for r in table] == [
        ("1+1=", "2", 1.0, 0.7, 3),
        ("1+1=", "3", 0.0, -0.7, 3),
        ("hi", tokenizer.decode([11, 12]), 0.5, 0.0, 4),
    ]
    assert len(sample_table(groups, [0.7, -0.7, 0.0], 5, tokenizer, limit=2)) == 2
    assert prompt_text({"prompt_token_ids": tokenizer("ab", add_special_tokens=False)["input_ids"]}, tokenizer) == "ab"
    assert "a\\|b⏎c" in markdown([{**table[0], "completion": "a|b\nc"}])


@pytest.mark.timeout(300)
def test_a_run_logs_its_samples_to_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_config(
        [
            "+experiment=arithmetic",
            "max_steps=4",
            "logger=[csv,tensorboard,wandb]",
            "logger.wandb.offline=true",
            "callbacks.sample_log.every_n_steps=2",
            "callbacks.sample_log.max_samples=5",
            "output_model_id=null",
            "data.prompt_groups_per_step=2",
            "data.completions_per_prompt=4",
            "trainer.enable_progress_bar=false",
            f"output_dir={tmp_path}",
        ]
    )
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 5 + [4] * 5
    assert set(rows[0]) == {"step", "prompt", "completion", "reward", "advantage", "finish_reason", "version"}
    assert all(r["prompt"].endswith("=") and r["finish_reason"] in ("stop", "length") for r in rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # a dev extra

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 3]
    assert rows[0]["prompt"] in texts[0].tensor_proto.string_val[0].decode()

    tables = [
        f
        for root, _, files in os.walk(tmp_path / "wandb")
        for f in files
        if f.startswith("samples") and f.endswith(".table.json")
    ]
    assert len(tables) == 2
