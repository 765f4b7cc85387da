"""lit_grpo: GRPO-family reinforcement learning of language models on PyTorch Lightning."""

from typing import TYPE_CHECKING

__all__ = ["Completion", "PromptGroup", "RolloutBatch", "RolloutSample", "RolloutSetup", "Sampler"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from lit_grpo.types import Completion, PromptGroup, RolloutBatch, RolloutSample, RolloutSetup, Sampler


def __getattr__(name: str):
    # The types import torch: loaded on first use, so that the command line can refuse a bad
    # config before torch loads (`lit_grpo.train`).
    if name in __all__:
        from lit_grpo import types

        return getattr(types, name)
    raise AttributeError(f"module 'lit_grpo' has no attribute {name!r}")
