"""What a new user meets in the first hour (issue 41): torch's thread count for a tiny model, the progress
bar, a refused run's folder, the first word of every refusal, and the built site's links."""

from __future__ import annotations

import pytest

from lit_grpo.config import ConfigError, TrainerConfig
from lit_grpo.config.trainer import SMALL_MODEL_PARAMS
from lit_grpo.models.load import cpu_threads


def test_a_tiny_model_runs_on_one_torch_thread_unless_the_user_chose():
    tiny, big = 300_000, 500_000_000  # the demo's policy; a 0.5B one
    assert cpu_threads(None, tiny, {}) == 1
    assert cpu_threads(None, SMALL_MODEL_PARAMS, {}) is None  # a real model keeps torch's default
    assert cpu_threads(None, big, {}) is None
    assert cpu_threads(None, tiny, {"OMP_NUM_THREADS": "2"}) is None  # the environment's choice stands
    assert cpu_threads(3, tiny, {"OMP_NUM_THREADS": "2"}) == 3  # and the config's wins over both
    assert cpu_threads(4, big, {}) == 4
    with pytest.raises(ConfigError, match="trainer.cpu_threads"):
        TrainerConfig(cpu_threads=0)
