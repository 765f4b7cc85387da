"""The transformers sampler: batched requests, finish reasons, logprobs that match the trainer."""

import asyncio

import pytest
import torch

from lit_grpo.module import token_logprobs
from lit_grpo.samplers.hf import HFSampler


def _sample(sampler, prompts, **kw):
    async def run():
        return await asyncio.gather(*(sampler.sample_with_prompt_tokens(p, n=1, **kw) for p in prompts))

    return [c for group in asyncio.run(run()) for c in group]


def test_concurrent_requests_share_one_generate_call(tiny_model, tokenizer, monkeypatch):
    sampler = HFSampler(tiny_model, tokenizer)
    calls = []
    original = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda prompts, t, m: calls.append(len(prompts)) or original(prompts, t, m))
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "3+44=", "5="]]
    completions = _sample(sampler, prompts, temperature=1.0, max_tokens=5)
    assert calls == [3]
    for p, c in zip(prompts, completions):
        assert c.full_tokens[: c.prompt_len] == p
        generated = len(c.full_tokens) - c.prompt_len
        assert 1 <= generated <= 5 and len(c.sampling_logprobs) == generated
        assert c.finish_reason == ("stop" if c.full_tokens[-1] == tokenizer.eos_token_id else "length")
        assert c.finish_reason == "stop" or generated == 5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_trainer_logprobs(tiny_model, tokenizer, temperature):
    sampler = HFSampler(tiny_model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3="]]
    for c in _sample(sampler, prompts, temperature=temperature, max_tokens=6):
        tokens = torch.tensor([c.full_tokens])
        trainer_lp, _ = token_logprobs(tiny_model, tokens, torch.ones_like(tokens), temperature)
        torch.testing.assert_close(trainer_lp[0, c.prompt_len - 1 :], torch.tensor(c.sampling_logprobs), atol=1e-4, rtol=0)


def test_update_weights_changes_the_samplers_model(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    (before,) = _sample(sampler, [prompt], max_tokens=4)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    sampler.update_weights(tiny_model.named_parameters())
    for name, p in tiny_model.named_parameters():
        assert torch.equal(dict(sampler.model.named_parameters())[name], p)
    tokens = torch.tensor([before.full_tokens])
    new_lp, _ = token_logprobs(sampler.model, tokens, torch.ones_like(tokens), 1.0)
    assert not torch.allclose(new_lp[0, before.prompt_len - 1 :], torch.tensor(before.sampling_logprobs), atol=1e-3)


def test_update_weights_accepts_wrapped_names_and_refuses_unknown_ones(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    sampler.update_weights((f"_forward_module.policy.{k}", v) for k, v in tiny_model.named_parameters())
    with pytest.raises(KeyError, match="no counterpart"):
        sampler.update_weights([("not.a.weight", torch.zeros(1))])
    with pytest.raises(RuntimeError, match="stale"):
        sampler.update_weights(list(tiny_model.named_parameters())[:1])


def test_truncated_sampling_is_refused(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="top_p"):
        _sample(sampler, [[5, 6]], top_p=0.9)


def test_chat_messages_go_through_the_template(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)

    async def run():
        return await sampler.sample_with_tokens([{"role": "user", "content": "1+1="}], n=2, max_tokens=3)

    completions = asyncio.run(run())
    assert len(completions) == 2
    expected = tokenizer("<|user|>1+1=<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    assert completions[0].full_tokens[: completions[0].prompt_len] == expected


def test_a_weight_sync_behind_a_stuck_generate_call_times_out(tiny_model, tokenizer):
    import threading
    import time

    from lit_grpo.samplers.base import SamplerTimeout

    sampler = HFSampler(tiny_model, tokenizer)
    sampler.call_timeout_s = 0.2
    stuck = threading.Event()

    def stuck_generate():  # holds the engine, as a generate call that never returns would
        with sampler._weights_lock:
            stuck.wait(5)

    holder = threading.Thread(target=stuck_generate)
    holder.start()
    time.sleep(0.05)
    start = time.perf_counter()
    with pytest.raises(SamplerTimeout, match="weight sync"):
        sampler.update_weights(tiny_model.state_dict().items())
    assert time.perf_counter() - start < 2
    stuck.set()
    holder.join()
    sampler.update_weights(tiny_model.state_dict().items())  # free again: it loads
    sampler.close()
