"""What every sampler shares: sampling-argument checks, client-side chat templating, weight names."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

# Prefixes Lightning and torch wrappers put in front of the policy's parameter names.
_WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.", "policy.")


def check_sample_kwargs(kwargs: dict[str, Any]) -> tuple[float, int]:
    """Validate sampling kwargs and return (temperature, max_tokens).

    Only untruncated sampling is offered: top_p < 1 or top_k > 0 would make the reported
    logprobs differ from the distribution the trainer's ratio assumes.
    """
    unknown = set(kwargs) - {"temperature", "max_tokens", "top_p", "top_k"}
    if unknown:
        raise ValueError(f"unknown sampling arguments {sorted(unknown)}; valid: temperature, max_tokens, top_p, top_k")
    if kwargs.get("top_p", 1.0) != 1.0 or kwargs.get("top_k", 0) not in (0, -1, None):
        raise ValueError("samplers only support top_p=1.0 and top_k=0: truncated sampling biases the logprobs")
    temperature = float(kwargs.get("temperature", 1.0))
    max_tokens = int(kwargs.get("max_tokens", 16))
    if temperature <= 0 or max_tokens <= 0:
        raise ValueError(f"temperature and max_tokens must be > 0, got {temperature}, {max_tokens}")
    return temperature, max_tokens


def chat_prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the policy's chat template, ending with the assistant cue."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def normalize_weight_name(name: str, known: dict) -> str:
    """Map a policy parameter name (possibly wrapped by Lightning/DDP/compile) onto the sampler's."""
    key = name
    while key not in known:
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        else:
            raise KeyError(f"policy weight {name!r} has no counterpart in the sampler")
    return key
