"""`+experiment=gsm8k`: composes, runs on CPU with real GSM8K rows, fails fast offline; greedy
evaluation; bad rows named by line before any model loads; the wandb and TensorBoard loggers."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.config import DataConfig
from lit_grpo.loop.evaluation import greedy_reward_sum
from lit_grpo.run.validate import validate
from lit_grpo.tasks.gsm8k_rows import RowError
from lit_grpo.train import train
from lit_grpo.types import Completion

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "gsm8k_test_sample.jsonl"
# The experiment on CPU: the tiny model and the transformers sampler, vendored rows, a short budget.
ON_CPU = [
    "+experiment=gsm8k",
    "model=tiny",
    "sampler=hf",
    "trainer=cpu",
    "model.max_position_embeddings=1024",
    f"task.path={SAMPLE}",
    f"task.eval_path={SAMPLE}",
    "data.eval_rows=6",
    "data.prompt_groups_per_step=2",
    "data.completions_per_prompt=4",
    "sampler.max_completion_tokens=24",
    "batching.micro_batch_size=0",
    "trainer.enable_progress_bar=false",
    "~callbacks.reward_filter",  # a random-init model never solves GSM8K: every group is uniform (all 0)
]


def test_the_experiment_composes_as_the_gpu_recipe(tmp_path):
    c = validate(compose_config("+experiment=gsm8k", output_dir=tmp_path))
    assert (c.model.kind, c.model.name_or_path, c.sampler.kind, c.task["name"]) == (
        "hf",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "vllm",
        "gsm8k",
    )
    assert (c.task["dataset"], c.task["dataset_config"], c.trainer.accelerator) == ("openai/gsm8k", "main", "gpu")
    assert c.data.eval_rows > 0 and c.eval_interval > 0
    # Every field stays overridable from the command line.
    c = validate(
        compose_config("+experiment=gsm8k", "data.completions_per_prompt=4", "learning_rate=3e-6", output_dir=tmp_path)
    )
    assert (c.data.completions_per_prompt, c.learning_rate) == (4, 3e-6)


def test_the_smollm2_recipe_asks_for_a_short_working_and_scores_the_format_beside_correctness(tmp_path):
    from lit_grpo.tasks.gsm8k import BUNDLED_FILES, GSM8KOptions, load_split

    c = validate(compose_config("+experiment=smollm2_gsm8k", output_dir=tmp_path))
    assert (c.model.name_or_path, c.sampler.kind, c.task["path"], c.task["eval_path"]) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct", "hf", "bundled", "bundled"
    )  # fmt: skip
    assert list(c.reward.fn) == ["gsm8k", "gsm8k_format"] and list(c.reward.weights) == [1.0, 0.5]
    row = load_split(GSM8KOptions(path="bundled", prompt_template=c.task["prompt_template"]), held_out=False, limit=1)[
        0
    ]
    first = BUNDLED_FILES["train"].read_text(encoding="utf-8").splitlines()[0]
    question = json.loads(first)["question"]
    assert row["messages"] == [
        {
            "role": "user",
            "content": f"{question}\n\nSolve it in at most three short sentences, then write the final answer on its "
            "own line as '#### <number>'.",
        }
    ]


def test_fast_dev_run_on_cpu_with_real_gsm8k_rows(tmp_path):
    summary = train(compose_config(*ON_CPU, "trainer.fast_dev_run=true", output_dir=tmp_path))
    assert summary["steps"] == 1
    assert 0.0 <= summary["eval_accuracy"] <= 1.0  # the end-of-run evaluation ran on the held-out rows


def test_evaluation_every_n_steps_is_logged(tmp_path):
    summary = train(
        compose_config(
            *ON_CPU,
            "max_steps=4",
            "eval_interval=2",
            "checkpoint.save_interval=0",
            "output_model_id=null",
            output_dir=tmp_path,
        )
    )
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    evaluated = sorted(int(r["step"]) for r in rows if r.get("eval/accuracy"))
    assert evaluated == [1, 3]  # after rollout steps 2 and 4 (logged at 0-based steps)
    assert "eval_accuracy" in summary


class _ScriptedSampler:
    """Answers each prompt with a fixed text; records the temperature it was asked for."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.temperatures = list(texts), []

    def generate(self, prompts, temperature, max_tokens):
        self.temperatures.append(temperature)
        return [
            Completion(
                full_tokens=[*p, 1],
                prompt_len=len(p),
                sampling_logprobs=[0.0],
                finish_reason="stop",
                text=self.texts.pop(0),
            )
            for p in prompts
        ]


def test_greedy_evaluation_scores_each_row_once_greedily(tokenizer):
    from lit_grpo.rewards.gsm8k import score

    rows = [{"prompt_token_ids": [5, 6], "answer": a} for a in ("18", "3", "70000", "540")]
    sampler = _ScriptedSampler(["so #### 18", "The answer is 4.", "A: 70,000", "540 meters"])
    accuracy = _greedy_accuracy(
        sampler, tokenizer, rows, lambda text, row: score(text, row["answer"]), max_tokens=8, batch_size=3
    )
    assert accuracy == pytest.approx(3 / 4)
    assert sampler.temperatures == [0.0, 0.0]  # greedy, in batches of at most 3


def test_with_a_weighted_reward_list_the_evaluation_logs_each_component_beside_the_sum(tokenizer):
    from lit_grpo.loop.evaluation import GreedyEvaluator
    from lit_grpo.rewards import get_reward
    from lit_grpo.rewards.combine import WeightedReward
    from lit_grpo.rewards.scoring import RewardScorer

    rows = [{"prompt_token_ids": [5, 6], "answer": a} for a in ("18", "3", "7", "540")]
    sampler = _ScriptedSampler(["#### 18", "so #### 3 then", "The answer is 7.", "#### 5"])
    parts = [(name, get_reward(name)) for name in ("gsm8k", "gsm8k_format")]
    reward = RewardScorer(WeightedReward(parts, [1.0, 0.5]))
    evaluator = GreedyEvaluator(sampler, tokenizer, rows, reward, max_tokens=8, batch_size=4)
    metrics = evaluator.evaluate(3)
    # correct: rows 0, 1, 2; in format: rows 0 and 3; the sum: (1 + 0.5) + 1 + 1 + 0.5 over 4 rows
    assert metrics == pytest.approx(
        {"eval/accuracy": 4 / 4, "eval/reward/gsm8k": 3 / 4, "eval/reward/gsm8k_format": 2 / 4}
    )
    restored = GreedyEvaluator(sampler, tokenizer, rows, reward)
    restored.load_state_dict(evaluator.state_dict())
    assert restored.last_metrics == metrics


def test_a_malformed_row_is_named_by_line_before_any_model_loads(tmp_path, monkeypatch):
    import lit_grpo.build

    monkeypatch.setattr(
        lit_grpo.build, "load_policy", lambda *a, **k: pytest.fail("a model was loaded before the rows were checked")
    )
    bad = tmp_path / "train.jsonl"
    lines = SAMPLE.read_text().splitlines()[:3]
    lines.insert(1, json.dumps({"question": "How many?", "answer": "no number here"}))
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(RowError, match=r"train\.jsonl line 2: field 'answer' holds no number"):
        train(compose_config(*ON_CPU, f"task.path={bad}", "trainer.fast_dev_run=true", output_dir=tmp_path / "run"))


def test_skip_mode_drops_the_bad_row_and_trains(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(
        SAMPLE.read_text().splitlines()[0] + "\n{not json\n" + "\n".join(SAMPLE.read_text().splitlines()[1:4]) + "\n"
    )
    summary = train(
        compose_config(
            *ON_CPU, f"task.path={bad}", "task.on_error=skip", "trainer.fast_dev_run=true", output_dir=tmp_path / "run"
        )
    )
    assert summary["steps"] == 1


def test_offline_the_cli_fails_fast_with_one_message(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty_cache"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=gsm8k", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    for needle in ("Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k", "model.name_or_path=", "task.path="):
        assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def _wandb_run_file(run_dir: Path) -> bytes:
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0].read_bytes()


def test_wandb_offline_run_writes_its_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=3",
            "logger=wandb",
            "logger.wandb.name=offline-test",
            "callbacks.reward_histogram.every_n_steps=1",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    import wandb

    assert wandb.run is None  # finished by `fit`: a next job in this process starts its own run
    wandb.teardown()  # the run is finished; wait for wandb's service process to finish writing its file
    data = _wandb_run_file(tmp_path)
    assert b"reward/mean" in data and b"reward/histogram" in data and b"offline-test" in data
    rewards = json.loads((tmp_path / "summary.json").read_text())["reward_curve"]
    assert len(rewards) == 3 == summary["steps"]
    for value in rewards:  # wandb stores each logged value as JSON in the run's record log
        assert json.dumps(value).encode() in data


def test_tensorboard_gets_scalars_and_reward_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=3",
            "logger=tensorboard",
            "callbacks.reward_histogram.every_n_steps=1",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0}).Reload()  # 0: keep all
    rewards = json.loads((tmp_path / "summary.json").read_text())["reward_curve"]
    assert [e.value for e in events.Scalars("reward/mean")] == pytest.approx(rewards)
    histograms = events.Histograms("reward/histogram")
    assert [h.step for h in histograms] == [0, 1, 2]
    assert histograms[0].histogram_value.num == 64  # the step's B = 8 × 8 rewards


def test_rows_through_hugging_face_datasets_match_the_jsonl_loader(tmp_path):
    from lit_grpo.config import DataConfig, TrainConfig
    from lit_grpo.tasks import build_eval_rows, build_rows
    from lit_grpo.tasks.gsm8k_rows import load_jsonl_rows

    folder = tmp_path / "gsm8k_copy"  # a dataset folder `datasets.load_dataset` reads, splits by file name
    folder.mkdir()
    lines = SAMPLE.read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:30]) + "\n")
    (folder / "test.jsonl").write_text("\n".join(lines[30:]) + "\n")
    c = TrainConfig(
        task={"name": "gsm8k", "dataset": str(folder), "dataset_config": None}, data=DataConfig(eval_rows=5)
    )
    assert build_rows(c) == load_jsonl_rows(folder / "train.jsonl")[0]
    assert build_eval_rows(c) == load_jsonl_rows(folder / "test.jsonl", max_rows=5)[0]


def test_without_the_datasets_extra_the_error_names_it(monkeypatch):
    from lit_grpo.config import TrainConfig
    from lit_grpo.tasks import build_rows

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"lit_grpo\[datasets\].*task\.path="):
        build_rows(TrainConfig(task={"name": "gsm8k"}))


def test_cookbook_chat_rows_keep_their_id_and_solution_and_score_a_boxed_answer(tmp_path):
    from lit_grpo.config import TrainConfig
    from lit_grpo.tasks import build_rows, reward_fn

    raw = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:3]]
    records = [
        {"id": f"gsm8k-{i}", "messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
        for i, r in enumerate(raw)
    ]
    path = tmp_path / "cookbook.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    c = TrainConfig(task={"name": "gsm8k", "path": str(path)}, data=DataConfig(eval_rows=0))
    rows = build_rows(c)
    assert rows == records  # the id kept, the whole solution kept as the answer
    final = rows[0]["answer"].rsplit("####", 1)[1].strip()
    assert reward_fn(c)(f"... so the answer is $\\boxed{{{final}}}$.", rows[0]) == 1.0
    assert reward_fn(c)("\\boxed{-1}", rows[0]) == 0.0


def _greedy_accuracy(*args, **kwargs) -> float:
    total, scored = greedy_reward_sum(*args, **kwargs)
    return total / scored
