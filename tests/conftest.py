"""Shared fixtures: compose the real `conf/` tree, build the tiny model and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig

from lit_grpo.config import ModelConfig
from lit_grpo.models import build_char_tokenizer, build_tiny_model
from lit_grpo.train import CONF_DIR
from lit_grpo.train import compose_config as lit_compose



def compose_config(*overrides: str, output_dir: Path | str = ".") -> DictConfig:
    """The config `python -m lit_grpo.train <overrides>` would run, with output in `output_dir`."""
    return lit_compose([*overrides, f"output_dir={output_dir}"])


@pytest.fixture
def tokenizer():
    return build_char_tokenizer("printable")


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_model(ModelConfig(), len(tokenizer), seed=0, tokenizer=tokenizer)
