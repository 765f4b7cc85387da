"""The transformers sampler: batched requests, finish reasons, logprobs that match the trainer."""

import asyncio
import copy
import math

import pytest
import torch
from test_sampler_kwargs import check_stop_contract, reference_cut

from lit_grpo.loop.module import token_logprobs
from lit_grpo.samplers.arguments import PromptTooLong
from lit_grpo.samplers.hf import HFSampler, chosen_logprobs, draw_tokens


def _sample(sampler, prompts, **kw):
    async def run():
        return await asyncio.gather(*(sampler.sample_with_prompt_tokens(p, n=1, **kw) for p in prompts))

    return [c for group in asyncio.run(run()) for c in group]


def test_concurrent_requests_share_one_generate_call(tiny_model, tokenizer, monkeypatch):
    sampler = HFSampler(tiny_model, tokenizer)
    calls = []
    original = sampler.generate
    monkeypatch.setattr(
        sampler, "generate", lambda prompts, t, m: calls.append(len(prompts)) or original(prompts, t, m)
    )
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "3+44=", "5="]]
    completions = _sample(sampler, prompts, temperature=1.0, max_tokens=5)
    assert calls == [3]
    for p, c in zip(prompts, completions):
        assert c.full_tokens[: c.prompt_len] == p
        generated = len(c.full_tokens) - c.prompt_len
        assert 1 <= generated <= 5 and len(c.sampling_logprobs) == generated
        assert c.finish_reason == ("stop" if c.full_tokens[-1] == tokenizer.eos_token_id else "length")
        assert c.finish_reason == "stop" or generated == 5


def _trainer_logprobs(model, c, temperature):
    tokens = torch.tensor([c.full_tokens])
    return token_logprobs(model, tokens, torch.ones_like(tokens), temperature)[0][0, c.prompt_len - 1 :]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_sampler_logprobs_equal_trainer_logprobs(tiny_model, tokenizer, temperature):
    sampler = HFSampler(tiny_model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3="]]
    for c in _sample(sampler, prompts, temperature=temperature, max_tokens=6):
        # sampling_logprobs: the distribution sampled from (greedy: reported at temperature 1);
        # inference_logprobs: the raw model, temperature 1.
        torch.testing.assert_close(
            torch.tensor(c.sampling_logprobs), _trainer_logprobs(tiny_model, c, temperature or 1.0), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(c.inference_logprobs), _trainer_logprobs(tiny_model, c, 1.0), atol=1e-4, rtol=0
        )
        if temperature == 0.7:
            assert (torch.tensor(c.sampling_logprobs) - torch.tensor(c.inference_logprobs)).abs().max() > 1e-2


@pytest.mark.timeout(60)
def test_a_released_models_generation_config_changes_neither_the_draw_nor_the_scores(tiny_model, tokenizer):
    # A released model ships sampling defaults (Qwen2.5-Instruct: top-p 0.8, top-k 20, repetition
    # penalty 1.05) that generate fills into every unset field; the sampler's must not apply.
    from transformers import GenerationConfig

    model = copy.deepcopy(tiny_model)
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.3, top_p=0.5, top_k=3, repetition_penalty=1.5,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    sampler = HFSampler(model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3="]]
    for c in _sample(sampler, prompts, temperature=1.0, max_tokens=6):
        torch.testing.assert_close(
            torch.tensor(c.sampling_logprobs), _trainer_logprobs(model, c, 1.0), atol=1e-4, rtol=0
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.3, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_step_scoring_equals_the_naive_log_softmax(temperature, dtype):
    """The recorder's per-step scoring (chosen logit less a logsumexp) against the naive formula it
    replaces, raw and tempered, at a wide vocabulary with large logits and a masked (-inf) entry."""
    generator = torch.Generator().manual_seed(0)
    logits_NV = (torch.randn(6, 50_000, generator=generator) * 8 + 20).to(dtype)
    logits_NV[0, :100] = float("-inf")  # a processor before ours may mask ids
    tokens_N = torch.randint(100, 50_000, (6,), generator=generator)
    sampling_N, raw_N = chosen_logprobs(logits_NV, tokens_N, temperature)
    naive = logits_NV.float()
    expected_raw = torch.log_softmax(naive, dim=-1).gather(-1, tokens_N[:, None])[:, 0]
    expected_sampling = torch.log_softmax(naive / temperature, dim=-1).gather(-1, tokens_N[:, None])[:, 0]
    assert raw_N.dtype == sampling_N.dtype == torch.float32
    torch.testing.assert_close(raw_N, expected_raw, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(sampling_N, expected_sampling, atol=1e-5, rtol=1e-6)
    if temperature != 1.0:  # the two differ, so a swapped or untempered formula fails above
        assert (sampling_N - raw_N).abs().max() > 1e-1


def test_the_lm_head_gets_a_contiguous_input_while_the_sampler_generates(tiny_model, tokenizer):
    """The prefill's last-position slice reaches the head as a strided view (a bmm over the rows
    when no weight requires grad); the sampler hands it over contiguous, and removes its hook."""
    seen: list[bool] = []
    head = tiny_model.get_output_embeddings()
    recorder = head.register_forward_hook(lambda module, args, out: seen.append(args[0].is_contiguous()))
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3="]]
    ids = torch.tensor([[tokenizer.pad_token_id] + prompts[0], prompts[1]])
    tiny_model.generate(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), max_new_tokens=2)
    assert not seen[0]  # generate on its own: the prefill's slice is strided
    seen.clear()
    _sample(HFSampler(tiny_model, tokenizer, share_weights=True), prompts, temperature=1.0, max_tokens=3)
    assert seen and all(seen)
    recorder.remove()
    assert not head._forward_pre_hooks


def test_stop_strings_cut_the_generation_that_would_have_been(tiny_model, tokenizer):
    """With the same seed, a generation with stop strings is the one without, cut at the first
    token that completes one of them (kept), and the batch ends once every row has stopped."""
    sampler = HFSampler(tiny_model, tokenizer)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3=", "7*8=", "hello "]]
    torch.manual_seed(0)
    free = _sample(sampler, prompts, temperature=0.7, max_tokens=30)
    texts = [c.text for c in free]
    assert all(len(t) >= 12 for t in texts)
    stops = [
        texts[0][6:8],
        texts[1][3:6],
        texts[2][9:11],
        texts[3][1:3],
        "\n\n",
    ]  # multi-character, at different depths
    steps = []
    original = sampler.model.generate
    sampler.model.generate = lambda **kw: (
        (out := original(**kw)) and steps.append(out.sequences.shape[1] - kw["input_ids"].shape[1]) or out
    )
    torch.manual_seed(0)
    cut = _sample(sampler, prompts, temperature=0.7, max_tokens=30, stop=stops, logprobs=True)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for f, c in zip(free, cut):
        generated = f.full_tokens[f.prompt_len :]
        expected = reference_cut(generated, stops, decode)
        assert expected is not None and c.stop_reason == expected[2] and c.finish_reason == "stop"
        assert c.full_tokens == f.full_tokens[: f.prompt_len + expected[0]] and c.text == expected[1]
        assert (
            c.sampling_logprobs == f.sampling_logprobs[: expected[0]]
            and c.inference_logprobs == f.inference_logprobs[: expected[0]]
        )
        assert decode(c.full_tokens[c.prompt_len :]) == c.text + c.stop_reason and not any(s in c.text for s in stops)
        check_stop_contract(c, stops, tokenizer, 30)
        torch.testing.assert_close(
            torch.tensor(c.sampling_logprobs), _trainer_logprobs(tiny_model, c, 0.7), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(c.inference_logprobs), _trainer_logprobs(tiny_model, c, 1.0), atol=1e-4, rtol=0
        )
    assert steps == [max(len(c.full_tokens) - c.prompt_len for c in cut)] and steps[0] < 30


@pytest.mark.timeout(120)
def test_concurrent_requests_with_other_stop_lists_get_their_own_cut(tiny_model, tokenizer, monkeypatch):
    sampler = HFSampler(tiny_model, tokenizer)
    calls = []
    original = sampler.generate
    monkeypatch.setattr(
        sampler,
        "generate",
        lambda prompts, t, m, *stop: calls.append((len(prompts), *stop)) or original(prompts, t, m, *stop),
    )
    stop_lists = [list("0123456789"), list("aeiouAEIOU"), None]
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3=", "7*8=", "hello "]]

    async def run():
        return await asyncio.gather(
            *(
                sampler.sample_with_prompt_tokens(p, n=1, temperature=1.0, max_tokens=40, stop=stop)
                for stop in stop_lists
                for p in prompts
            )
        )

    torch.manual_seed(0)
    results = [c for group in asyncio.run(run()) for c in group]
    assert sorted(calls, key=str) == sorted([(4, tuple(stop_lists[0])), (4, tuple(stop_lists[1])), (4,)], key=str)
    for i, c in enumerate(results):
        stop = stop_lists[i // len(prompts)] or []
        check_stop_contract(c, stop, tokenizer, 40)
        torch.testing.assert_close(
            torch.tensor(c.sampling_logprobs), _trainer_logprobs(tiny_model, c, 1.0), atol=1e-4, rtol=0
        )
    assert sum(c.stop_reason is not None for c in results) >= 4  # the cut was exercised


@pytest.mark.timeout(120)
def test_max_seq_len_bounds_prompt_and_completion(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    (free,) = _sample(sampler, [prompt], temperature=0.0, max_tokens=10)
    assert free.finish_reason == "length"  # greedy runs on past the bound
    (c,) = _sample(sampler, [prompt], temperature=0.0, max_tokens=10, max_seq_len=7)
    assert c.full_tokens == free.full_tokens[:7] and c.finish_reason == "length" and len(c.sampling_logprobs) == 3
    with pytest.raises(PromptTooLong, match="max_seq_len=4"):
        _sample(sampler, [prompt], max_tokens=10, max_seq_len=4)


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


def test_truncated_sampling_unknown_keywords_and_top_k_logprobs_are_refused(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="top_p"):
        _sample(sampler, [[5, 6]], top_p=0.9)
    with pytest.raises(ValueError, match="unknown sampling arguments"):
        _sample(sampler, [[5, 6]], frequency_penalty=0.5)
    with pytest.raises(ValueError, match="logprobs=5"):
        _sample(sampler, [[5, 6]], logprobs=5)


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

    from lit_grpo.samplers.arguments import SamplerTimeout

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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_drawn_tokens_follow_the_tempered_softmax(temperature):
    # 200,000 draws of each row: every id's frequency within 5 standard errors of its probability
    # softmax(logits / T), worked out with Python's math; an id at -inf is never drawn.
    logits_NV = torch.tensor([[2.0, 0.5, -1.0, 1.0, float("-inf")], [0.0, 0.0, 3.0, -2.0, 1.0]])
    draws = 200_000
    torch.manual_seed(0)
    tokens_DN = torch.stack([draw_tokens(logits_NV.repeat(1000, 1), temperature).view(1000, 2) for _ in range(200)])
    tokens_DN = tokens_DN.view(draws, 2)
    for row in range(2):
        weights = [0.0 if x == float("-inf") else math.exp(x / temperature) for x in logits_NV[row].tolist()]
        want = [w / sum(weights) for w in weights]
        counts = torch.bincount(tokens_DN[:, row], minlength=5).tolist()
        for i, p in enumerate(want):
            sigma = (p * (1 - p) / draws) ** 0.5
            assert abs(counts[i] / draws - p) <= 5 * sigma + 1e-12, (row, i, counts[i] / draws, p)
    assert (tokens_DN[:, 0] != 4).all()


@pytest.mark.timeout(30)
def test_drawn_tokens_follow_the_global_seed():
    logits_NV = torch.randn(3, 50)
    torch.manual_seed(7)
    first = draw_tokens(logits_NV, 1.0)
    torch.manual_seed(7)
    assert torch.equal(draw_tokens(logits_NV, 1.0), first)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_shared_prompt_is_prefilled_once_and_samples_as_if_each_copy_were(tokenizer, temperature):
    """Groups of one prompt (ragged lengths, left-padded together) sample the same tokens with the
    same logprobs (to float32 rounding) whether each distinct prompt is encoded once or every copy
    is; the prefill's forward sees the distinct prompts only, and the tokens it did not encode are counted."""
    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import build_tiny_model

    tiny_model = build_tiny_model(ModelConfig(dtype="float32"), len(tokenizer), seed=0, tokenizer=tokenizer)
    texts = ["12+34=", "7+1=", "12+34=", "7+1=", "99+1=", "12+34=", "7+1="]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    results = {}
    for share in (False, True):
        sampler = HFSampler(tiny_model, tokenizer, share_prompt_prefill=share)
        widths = []
        # a hook, not a wrapped forward: generate reads the forward's signature to choose its inputs
        hook = sampler.model.register_forward_pre_hook(
            lambda module, args, kwargs, seen=widths: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
        )
        torch.manual_seed(5)
        results[share] = sampler._generate(prompts, temperature, 6)
        hook.remove()
        if share:
            width = max(map(len, prompts))
            assert widths[0] == (3, width - 1)  # the 3 distinct prompts, all but their last token
            assert widths[1] == (len(prompts), 1)  # then each row's last prompt token only
            padded = sum(len(p) - 1 for p in prompts) - sum(len(p) - 1 for p in prompts[:2] + prompts[4:5])
            assert sampler.prefill_tokens_saved == padded
        else:
            assert widths[0] == (len(prompts), max(map(len, prompts)))
    for plain, shared in zip(results[False], results[True]):
        assert shared.full_tokens == plain.full_tokens
        assert shared.sampling_logprobs == pytest.approx(plain.sampling_logprobs, abs=1e-5)


def test_a_batch_of_distinct_prompts_is_prefilled_as_before(tiny_model, tokenizer):
    from lit_grpo.samplers.shared_prefill import distinct_rows, shared_prompt_cache

    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9], [5, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    firsts, inverse = distinct_rows(ids, mask)
    assert firsts.tolist() == [0, 1, 4] and inverse.tolist() == [0, 1, 0, 1, 2]
    # the same ids under another mask are another prompt (a pad id that is also a real token)
    firsts, inverse = distinct_rows(ids[:2], torch.tensor([[1, 1, 1], [1, 1, 1]]))
    assert inverse.tolist() == [0, 1]
    assert shared_prompt_cache(tiny_model, ids[:2], mask[:2]) is None  # nothing shared: nothing to save
