"""lit_grpo: GRPO-family reinforcement learning of language models on PyTorch Lightning."""

from lit_grpo.types import Completion, PromptGroup, RolloutBatch, RolloutSample, RolloutSetup, Sampler

__all__ = ["Completion", "PromptGroup", "RolloutBatch", "RolloutSample", "RolloutSetup", "Sampler"]
__version__ = "0.1.0"
