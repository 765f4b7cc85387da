"""The transformers sampler: batched `generate` with a KV cache, on the sampler's own copy of the weights.

Logprobs are those of the sampling distribution: `log_softmax(logits / temperature)` with
top_p=1 and top_k=0, so they can serve as the behaviour policy in TIS.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.samplers.base import BatchingSampler, normalize_weight_name
from lit_grpo.types import Completion


class HFSampler(BatchingSampler):
    """Implements the `Sampler` protocol with `model.generate` on a private copy of the policy."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, max_batch_size: int = 256) -> None:
        super().__init__(tokenizer, max_batch_size=max_batch_size)
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The state dict (tied weights listed under every name) is what engines such as vLLM need.
        state = self.model.state_dict()
        seen = set()
        for name, tensor in named_tensors:
            key = normalize_weight_name(name, state)
            state[key].copy_(tensor.detach().to(state[key].device, state[key].dtype))
            seen.add(key)
        missing = set(self.model.state_dict()) - seen - _tied_aliases(self.model, seen)
        if missing:
            raise RuntimeError(f"weight sync left {len(missing)} sampler weights stale, e.g. {sorted(missing)[:3]}")

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        device = next(self.model.parameters()).device
        pad_id, eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        # Temperature 0 is greedy decoding (evaluation); its logprobs are reported at temperature 1.
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
        gen_config = GenerationConfig(
            **sampling, max_new_tokens=max_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
            output_logits=True, return_dict_in_generate=True,
        )
        temperature = temperature or 1.0
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_config)
        new_tokens_NS = out.sequences[:, width:].cpu()
        logits_NSV = torch.stack(out.logits, dim=1).float()
        logprobs_NS = torch.log_softmax(logits_NSV / temperature, dim=-1).gather(-1, new_tokens_NS.to(logits_NSV.device)[..., None])[..., 0].cpu()
        cut = [row[: row.index(eos_id) + 1] if eos_id in row else row for row in new_tokens_NS.tolist()]
        texts = self.tokenizer.batch_decode(cut, skip_special_tokens=True)
        return [self.completion(p, row, lp, text) for p, row, lp, text in zip(prompts, cut, logprobs_NS.tolist(), texts)]


def _tied_aliases(model: PreTrainedModel, loaded: set[str]) -> set[str]:
    """State-dict names that share storage with a loaded one (tied embeddings): loaded too."""
    state = model.state_dict()
    pointers = {state[k].data_ptr() for k in loaded}
    return {k for k, v in state.items() if v.data_ptr() in pointers}
