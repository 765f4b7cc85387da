"""Samplers behind one protocol (`lit_grpo.types.Sampler`); vLLM is imported only when chosen."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.config import ModelConfig, SamplerConfig
from lit_grpo.types import Sampler


def build_sampler(
    cfg: SamplerConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
    model: ModelConfig | None = None, work_dir: str = ".", seed: int = 0,
) -> Sampler:
    """The sampler named by `cfg.kind`, starting from the policy's current weights."""
    if cfg.kind == "vllm":
        from lit_grpo.models import save_pretrained
        from lit_grpo.samplers.vllm import VLLMSampler, import_vllm

        import_vllm()  # fail with the install hint before writing anything
        if model is not None and model.kind == "hf":
            source = model.name_or_path
        else:  # a model built here: the engine loads it from a folder written now
            source = str(save_pretrained(policy, tokenizer, Path(work_dir) / "sampler_init"))
        return VLLMSampler(
            source, tokenizer, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size, sleep_between_phases=cfg.sleep_between_phases,
            seed=seed, max_batch_size=cfg.max_batch_size,
        )
    from lit_grpo.samplers.hf import HFSampler

    return HFSampler(policy, tokenizer, max_batch_size=cfg.max_batch_size)
