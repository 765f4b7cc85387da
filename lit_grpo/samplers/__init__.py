"""Samplers behind one protocol (`lit_grpo.types.Sampler`); vLLM is imported only when chosen."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.config import SamplerConfig
from lit_grpo.types import Sampler


def build_sampler(cfg: SamplerConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Sampler:
    """The sampler named by `cfg.kind`, starting from the policy's current weights."""
    from lit_grpo.samplers.hf import HFSampler

    return HFSampler(policy, tokenizer, max_batch_size=cfg.max_batch_size)
