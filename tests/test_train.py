"""End to end: `train(cfg)` with a composed config, the real CLI, the custom filter, and learning."""

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.train import train
from lit_grpo.types import PromptGroup

REPO = Path(__file__).resolve().parents[1]
KEPT: list[int] = []


def keep_everything(group: PromptGroup) -> bool:
    """A custom group predicate for the filter test: records group sizes, keeps every group."""
    KEPT.append(len(group.samples))
    return True


def _exact_sum_reward(prompt: str, completion: str) -> float:
    """The arithmetic reward worked out independently of lit_grpo.rewards: 1 when the completion's
    leading whole number (after spaces) is the sum in the prompt `a+b=`."""
    a, b = re.fullmatch(r"(\d+)\+(\d+)=", prompt).groups()
    digits = re.match(r"\s*(-?\d+)", completion)
    return 1.0 if digits is not None and digits.group(1) == str(int(a) + int(b)) else 0.0


@pytest.mark.parametrize("experiment, groups, group_size", [("arithmetic", 8, 8), ("arithmetic_sums18", 8, 16)])
def test_train_fast_dev_run(tmp_path, experiment, groups, group_size):
    # No filter, so the step trains on every sample it drew, and the sample log keeps them all:
    # the logged reward must be the mean of those samples' rewards, recomputed from their text.
    summary = train(
        compose_config(
            f"+experiment={experiment}",
            "trainer.fast_dev_run=true",
            "~callbacks.reward_filter",
            "callbacks.sample_log.every_n_steps=1",
            "callbacks.sample_log.max_samples=1000",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1

    table = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(table) == groups * group_size
    assert {row["step"] for row in table} == {1}
    rewards = [_exact_sum_reward(row["prompt"], row["completion"]) for row in table]
    assert [row["reward"] for row in table] == rewards
    assert 0 < sum(rewards) < len(rewards)  # seed 0 draws both kinds: the mean below is no constant
    assert summary["final_reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
    assert summary["first_reward"] == summary["final_reward"]  # one step: both are its reward
    # (fast_dev_run writes no metrics.csv; the summary reads the same history the loggers get.)
    # GRPO advantages of each group of `group_size` consecutive samples: (r - mean) / (std + 1e-8),
    # std unbiased, 0 for a uniform group.
    for g in range(groups):
        rows = table[g * group_size : (g + 1) * group_size]
        assert len({row["prompt"] for row in rows}) == 1
        r = [row["reward"] for row in rows]
        mean, std = statistics.fmean(r), statistics.stdev(r)
        want = [0.0 if std == 0 else (x - mean) / (std + 1e-8) for x in r]
        assert [row["advantage"] for row in rows] == pytest.approx(want, abs=1e-6)


def test_custom_filter_predicate_from_config(tmp_path):
    KEPT.clear()
    cfg = compose_config(
        "+experiment=arithmetic",
        "trainer.fast_dev_run=true",
        "callbacks.reward_filter.predicate=test_train.keep_everything",
        output_dir=tmp_path,
    )
    train(cfg)
    assert KEPT == [8] * 8  # exactly one step's P groups of G, none rejected, none resampled


def test_cli_fast_dev_run_in_a_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_grpo.train",
            "+experiment=arithmetic",
            "trainer.fast_dev_run=true",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1


def test_cli_reports_a_bad_value_by_field(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "data.completions_per_prompt=1", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "data.completions_per_prompt" in proc.stderr


@pytest.mark.slow
def test_a_short_run_raises_the_reward(tmp_path):
    summary = train(
        compose_config(
            "+experiment=arithmetic", "max_steps=200", "trainer.enable_progress_bar=false", output_dir=tmp_path
        )
    )
    assert summary["steps"] == 200
    assert summary["final_reward"] > summary["first_reward"] + 0.15, summary
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    for key in [
        "reward/mean",
        "reward/std",
        "reward/max",
        "train/loss",
        "train/lr",
        "train/ref_kl",
        "train/clip_frac",
        "train/entropy",
        "rollout/completion_len_mean",
        "rollout/filtered_groups",
        "policy/version",
        "perf/step_s",
        "perf/weight_sync_s",
        "perf/sample_tokens_per_s",
    ]:
        assert key in header, key


def test_training_ends_cleanly_when_the_rows_run_out(tmp_path):
    # 16 rows, 8 per step, no filter: exactly two steps, and no hook runs for a third.
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "task.num_rows=16",
            "data.epochs=1",
            "max_steps=-1",
            "optim.lr_decay=constant",
            "~callbacks.reward_filter",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 2


@pytest.mark.slow
def test_policy_loss_multirun_writes_a_sweep_summary(tmp_path):
    losses = "grpo,importance_sampling,reinforce,dapo,dro,gspo,cispo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_grpo.train",
            "-m",
            "+experiment=arithmetic",
            f"policy_loss={losses}",
            "trainer.fast_dev_run=true",
            "trainer.enable_progress_bar=false",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "sweep_summary.csv").read_text().splitlines()
    assert rows[0].startswith("overrides,final_reward")
    assert len(rows) == 8
    for name in losses.split(","):
        override = f"policy_loss={name}"
        assert sum(override in r.split(",")[0].split(" ") for r in rows[1:]) == 1, name
        run_dirs = [d for d in tmp_path.iterdir() if d.is_dir() and override in d.name.split("_", 1)[-1].split(",")]
        assert len(run_dirs) == 1 and (run_dirs[0] / "summary.json").exists(), name
    assert (tmp_path / "sweep_rewards.png").stat().st_size > 0
    assert "Sweep summary" in proc.stdout


def test_a_short_runs_summary_means_over_half_the_run():
    """With fewer than 20 steps the window is half the run: first, final and best differ as the
    curve does (a 10-step window over 4 steps made all three the same mean)."""
    from lit_grpo.loop.metrics import MetricHistory
    from lit_grpo.train import summarize, summary_window

    history = MetricHistory()
    history.steps = [{"reward/mean": r} for r in (0.0, 0.5, 1.0, 0.25)]
    summary = summarize(history, "reward/mean", 1.0)
    assert (summary["first_reward"], summary["final_reward"], summary["best_reward"]) == (0.25, 0.625, 0.75)
    assert [summary_window(n) for n in (0, 1, 3, 10, 19, 20, 400)] == [1, 1, 1, 5, 9, 10, 10]
